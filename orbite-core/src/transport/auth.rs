//! Mutual authentication of peer connections: a shared secret (the
//! `auth.secret_file` of both engines), proven by each side with
//! HMAC-SHA256 before any other frame, as two sans-IO machines
//! ([`Initiator`], [`Responder`]) that the I/O code drives.
//!
//! The exchange, on every connection (data, watch and local socket):
//! 1. initiator: `AuthHello { nonce_i, epoch_i, epoch_r?, dialed, reached }`:
//!    its nonce and epoch, the responder epoch it expects (0 before it
//!    knows it), the endpoint it dialed as it named it, and the numeric
//!    address its connection reached (empty on a local socket);
//! 2. responder: `AuthChallenge { nonce_r, epoch_r, mac_r }`;
//! 3. initiator: `AuthProof { mac_i }`;
//! 4. responder: `AuthOk`.
//!
//! `mac_x = HMAC(secret, label_x | nonce_i | nonce_r | epoch_i | epoch_r |
//! dialed | reached)`, with a label per direction and the names length
//! prefixed. This is the three-pass keyed challenge-response of ISO/IEC
//! 9798-4 (as in SKID3), with the identities of both ends inside both
//! MACs so that no message of one run is accepted in another:
//! - the responder answers only a hello meant for it: not one claiming its
//!   own epoch (reflection), not one naming another responder's epoch, not
//!   one naming an endpoint it is not (a relay: the initiator dialed the
//!   relay's endpoint, which this responder neither advertises nor was
//!   reached at);
//! - the initiator accepts only a challenge from the responder it meant:
//!   not its own epoch, the epoch it expects when it knows one, a MAC over
//!   the endpoint it dialed and the address it reached.
//!
//! So a proof authenticates one connection, to the responder the
//! initiator meant. What the secret does not protect: an attacker on the
//! network path to a real endpoint can still read the frames and, after
//! the handshake, change or inject them (frames are neither encrypted nor
//! MACed one by one); use a private network or a tunnel against that.

use std::net::SocketAddr;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::{AUTH_MAC, AUTH_NONCE, AuthChallenge, AuthHello};

type HmacSha256 = Hmac<Sha256>;

/// Shortest secret accepted, in bytes.
pub(crate) const MIN_SECRET: usize = 16;

/// A shared secret.
pub(crate) struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why a secret file is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// It cannot be read.
    #[error("cannot read {path}: {err}")]
    Read {
        /// The file.
        path: String,
        /// The system's words.
        err: String,
    },
    /// Too few bytes.
    #[error("{path} holds {len} bytes; a secret needs at least {MIN_SECRET}")]
    TooShort {
        /// The file.
        path: String,
        /// Its bytes without trailing white space.
        len: usize,
    },
}

impl Secret {
    /// Reads a secret file: its bytes, without trailing white space; at
    /// least [`MIN_SECRET`] of them.
    pub fn load(path: &str) -> Result<Secret, SecretError> {
        let bytes = std::fs::read(path).map_err(|e| SecretError::Read { path: path.to_owned(), err: e.to_string() })?;
        let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        if end < MIN_SECRET {
            return Err(SecretError::TooShort { path: path.to_owned(), len: end });
        }
        Ok(Secret(bytes[..end].to_vec()))
    }

    /// A secret from bytes (tests).
    #[cfg(test)]
    pub fn from_bytes(b: &[u8]) -> Secret {
        Secret(b.to_vec())
    }

    /// The MAC of one direction over everything one run binds.
    fn mac(&self, label: &[u8], hello: &AuthHello, nonce_r: &[u8; AUTH_NONCE], epoch_r: u64) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(&hello.nonce);
        m.update(nonce_r);
        m.update(&hello.initiator_epoch.to_le_bytes());
        m.update(&epoch_r.to_le_bytes());
        for name in [&hello.dialed, &hello.reached] {
            m.update(&(name.len() as u64).to_le_bytes());
            m.update(name.as_bytes());
        }
        m
    }
}

const RESPONDER: &[u8] = b"orbite auth v2 responder";
const INITIATOR: &[u8] = b"orbite auth v2 initiator";

/// Why a handshake was refused (by either side). Every refusal closes the
/// connection and counts in `auth_failures`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// The other end claims this engine's own epoch.
    #[error("the peer claims this engine's own epoch {0:#x}")]
    OwnEpoch(u64),
    /// The hello names another responder's epoch.
    #[error("the hello is meant for epoch {meant:#x}, not this engine's {mine:#x}")]
    OtherResponder {
        /// What the hello names.
        meant: u64,
        /// This engine's.
        mine: u64,
    },
    /// The hello names an endpoint this responder neither advertises nor
    /// was reached at (a relayed hello).
    #[error("the hello is meant for {dialed:?} (reached at {reached:?}), which is not this engine")]
    OtherEndpoint {
        /// The endpoint the initiator dialed.
        dialed: String,
        /// The address it reached.
        reached: String,
    },
    /// The challenge proves another epoch than the one expected.
    #[error("the peer proved epoch {proven:#x} where {expected:#x} was expected")]
    UnexpectedEpoch {
        /// Expected.
        expected: u64,
        /// Proven.
        proven: u64,
    },
    /// A MAC that the secret did not make over this run.
    #[error("the {0} does not match this engine's secret")]
    BadMac(&'static str),
}

/// The endpoint an initiator dialed, as it names it in its hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Dialed {
    /// The endpoint as named: tcp `host:port`, or a local socket's name.
    pub name: String,
    /// The address the tcp connection reached (`None`: a local socket).
    pub reached: Option<SocketAddr>,
}

/// What a responder knows of itself and of the connection a hello came
/// on: what it answers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponderSelf {
    /// Its epoch.
    pub epoch: u64,
    /// The endpoint it advertises to peers (tcp `host:port`), if any.
    pub advertised: Option<String>,
    /// Its local socket's name, if it serves one.
    pub local_socket: Option<String>,
    /// The connection's end here: the local address a tcp connection
    /// reached (`getsockname`), or `None` on the local socket.
    pub reached_at: Option<SocketAddr>,
}

impl ResponderSelf {
    /// Whether a hello names this responder: on the local socket, its
    /// name; over tcp, the endpoint it advertises or the very address
    /// this connection reached.
    fn is_meant(&self, hello: &AuthHello) -> bool {
        match self.reached_at {
            None => hello.reached.is_empty() && self.local_socket.as_deref() == Some(hello.dialed.as_str()),
            Some(here) => {
                self.advertised.as_deref() == Some(hello.dialed.as_str())
                    || hello.reached.parse::<SocketAddr>().is_ok_and(|r| same_address(r, here))
            }
        }
    }
}

/// Two socket addresses name the same end (an IPv4 address and its
/// IPv4-mapped IPv6 form are one).
fn same_address(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
}

/// The initiator's side of one handshake.
#[derive(Clone)]
pub(crate) struct Initiator {
    secret: Arc<Secret>,
    hello: AuthHello,
    expect: Option<u64>,
}

impl Initiator {
    /// A handshake of an engine of epoch `mine` toward the endpoint it
    /// `dialed`, expecting the responder's epoch `expect` when it knows it;
    /// `nonce` fresh ([`nonce`]).
    pub fn new(secret: Arc<Secret>, mine: u64, expect: Option<u64>, dialed: &Dialed, nonce: [u8; AUTH_NONCE]) -> Self {
        let hello = AuthHello {
            nonce,
            initiator_epoch: mine,
            responder_epoch: expect.unwrap_or(0),
            dialed: dialed.name.clone(),
            reached: dialed.reached.map(|a| a.to_string()).unwrap_or_default(),
        };
        Initiator { secret, hello, expect }
    }

    /// The hello to send.
    pub fn hello(&self) -> &AuthHello {
        &self.hello
    }

    /// The responder's challenge: the proof to send (the responder's
    /// epoch is the challenge's), or why this responder is refused.
    pub fn on_challenge(&self, c: &AuthChallenge) -> Result<[u8; AUTH_MAC], Refusal> {
        if c.responder_epoch == self.hello.initiator_epoch {
            return Err(Refusal::OwnEpoch(c.responder_epoch));
        }
        if let Some(expected) = self.expect.filter(|e| *e != c.responder_epoch) {
            return Err(Refusal::UnexpectedEpoch { expected, proven: c.responder_epoch });
        }
        if self.secret.mac(RESPONDER, &self.hello, &c.nonce, c.responder_epoch).verify_slice(&c.mac).is_err() {
            return Err(Refusal::BadMac("responder's proof"));
        }
        Ok(self.secret.mac(INITIATOR, &self.hello, &c.nonce, c.responder_epoch).finalize().into_bytes().into())
    }
}

/// The responder's side of one handshake, once it answered the hello.
#[derive(Clone)]
pub(crate) struct Responder {
    secret: Arc<Secret>,
    hello: AuthHello,
    nonce: [u8; AUTH_NONCE],
    epoch: u64,
}

impl Responder {
    /// Answers a `hello` on a connection of responder `me`, with a fresh
    /// `nonce`: the challenge to send and the machine that waits for the
    /// proof, or why the hello is refused.
    pub fn on_hello(
        secret: Arc<Secret>,
        me: &ResponderSelf,
        hello: AuthHello,
        nonce: [u8; AUTH_NONCE],
    ) -> Result<(Responder, AuthChallenge), Refusal> {
        if hello.initiator_epoch == me.epoch {
            return Err(Refusal::OwnEpoch(me.epoch));
        }
        if hello.responder_epoch != 0 && hello.responder_epoch != me.epoch {
            return Err(Refusal::OtherResponder { meant: hello.responder_epoch, mine: me.epoch });
        }
        if !me.is_meant(&hello) {
            return Err(Refusal::OtherEndpoint { dialed: hello.dialed, reached: hello.reached });
        }
        let mac = secret.mac(RESPONDER, &hello, &nonce, me.epoch).finalize().into_bytes().into();
        let challenge = AuthChallenge { nonce, responder_epoch: me.epoch, mac };
        Ok((Responder { secret, hello, nonce, epoch: me.epoch }, challenge))
    }

    /// The initiator's proof: its epoch once proven, or why not.
    pub fn on_proof(&self, mac: &[u8]) -> Result<u64, Refusal> {
        self.secret
            .mac(INITIATOR, &self.hello, &self.nonce, self.epoch)
            .verify_slice(mac)
            .map(|()| self.hello.initiator_epoch)
            .map_err(|_| Refusal::BadMac("initiator's proof"))
    }
}

/// A fresh nonce from the kernel's random source.
pub(crate) fn nonce() -> [u8; AUTH_NONCE] {
    let mut n = [0u8; AUTH_NONCE];
    let mut at = 0;
    while at < n.len() {
        // SAFETY: getrandom writes at most the given length into the buffer.
        let r = unsafe { libc::getrandom(n[at..].as_mut_ptr().cast(), n.len() - at, 0) };
        if r > 0 {
            at += r as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            panic!("the kernel's random source failed: {}", std::io::Error::last_os_error());
        }
    }
    n
}

#[cfg(test)]
#[path = "auth_model.rs"]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: &[u8]) -> Arc<Secret> {
        Arc::new(Secret::from_bytes(b))
    }

    #[test]
    fn secret_files_are_refused_with_typed_reasons() {
        let dir = std::env::temp_dir();
        let missing = dir.join(format!("orbite-no-secret-{}", std::process::id()));
        let missing = missing.to_string_lossy().into_owned();
        assert!(matches!(Secret::load(&missing), Err(SecretError::Read { path, .. }) if path == missing));
        let short = dir.join(format!("orbite-short-secret-{}", std::process::id()));
        std::fs::write(&short, b"0123456789abcde \n").unwrap();
        let short = short.to_string_lossy().into_owned();
        assert_eq!(Secret::load(&short).unwrap_err(), SecretError::TooShort { path: short.clone(), len: 15 });
        std::fs::write(&short, b"0123456789abcdef\n").unwrap();
        assert!(Secret::load(&short).is_ok(), "16 bytes after trimming");
        std::fs::remove_file(&short).unwrap();
    }

    fn tcp(name: &str, reached: &str) -> Dialed {
        Dialed { name: name.into(), reached: Some(reached.parse().unwrap()) }
    }

    fn responder(epoch: u64, at: &str) -> ResponderSelf {
        ResponderSelf {
            epoch,
            advertised: Some(format!("host-{epoch}:7000")),
            local_socket: Some(format!("orbite-{epoch}")),
            reached_at: Some(at.parse().unwrap()),
        }
    }

    #[test]
    fn an_honest_run_authenticates_both_ends() {
        let s = secret(b"0123456789abcdef");
        let me = responder(2, "10.0.0.2:7000");
        for (dialed, expect) in
            [(tcp("host-2:7000", "10.0.0.2:7000"), Some(2)), (tcp("10.0.0.2:7000", "10.0.0.2:7000"), None)]
        {
            let i = Initiator::new(s.clone(), 1, expect, &dialed, nonce());
            let (r, c) = Responder::on_hello(s.clone(), &me, i.hello().clone(), nonce()).unwrap();
            let proof = i.on_challenge(&c).unwrap();
            assert_eq!(r.on_proof(&proof), Ok(1));
        }
        // Over the local socket, by its name; an IPv4-mapped address is
        // the same address.
        let local = ResponderSelf { reached_at: None, ..me.clone() };
        let i = Initiator::new(s.clone(), 1, Some(2), &Dialed { name: "orbite-2".into(), reached: None }, nonce());
        assert!(Responder::on_hello(s.clone(), &local, i.hello().clone(), nonce()).is_ok());
        let v6 = ResponderSelf { reached_at: Some("[::ffff:10.0.0.2]:7000".parse().unwrap()), ..me };
        let i = Initiator::new(s.clone(), 1, None, &tcp("somename:1", "10.0.0.2:7000"), nonce());
        assert!(Responder::on_hello(s, &v6, i.hello().clone(), nonce()).is_ok());
    }

    #[test]
    fn every_field_of_a_run_is_bound() {
        let s = secret(b"0123456789abcdef");
        let me = responder(2, "10.0.0.2:7000");
        let i = Initiator::new(s.clone(), 1, Some(2), &tcp("host-2:7000", "10.0.0.2:7000"), nonce());
        let (r, c) = Responder::on_hello(s.clone(), &me, i.hello().clone(), nonce()).unwrap();
        let proof = i.on_challenge(&c).unwrap();
        // A challenge changed in any field fails at the initiator.
        let mut bad = c;
        bad.nonce[0] ^= 1;
        assert_eq!(i.on_challenge(&bad), Err(Refusal::BadMac("responder's proof")));
        let other = Initiator::new(s.clone(), 1, None, &tcp("host-2:7000", "10.0.0.2:7000"), nonce());
        assert_eq!(other.on_challenge(&c), Err(Refusal::BadMac("responder's proof")), "another run's challenge");
        // Another secret proves nothing.
        let wrong = Initiator::new(
            secret(b"0123456789abcdeX"),
            1,
            Some(2),
            &tcp("host-2:7000", "10.0.0.2:7000"),
            i.hello.nonce,
        );
        assert_eq!(wrong.on_challenge(&c), Err(Refusal::BadMac("responder's proof")));
        // The directions differ: the responder's MAC is no initiator's proof.
        assert_eq!(r.on_proof(&c.mac), Err(Refusal::BadMac("initiator's proof")));
        assert_eq!(r.on_proof(&proof), Ok(1));
    }

    #[test]
    fn hellos_for_another_responder_and_reflections_are_refused() {
        let s = secret(b"0123456789abcdef");
        let me = responder(2, "10.0.0.2:7000");
        let hello = |mine, expect, d: Dialed| Initiator::new(s.clone(), mine, expect, &d, nonce()).hello().clone();
        let refused = |h: AuthHello| Responder::on_hello(s.clone(), &me, h, nonce()).err();
        assert_eq!(refused(hello(2, None, tcp("host-2:7000", "10.0.0.2:7000"))), Some(Refusal::OwnEpoch(2)));
        assert_eq!(
            refused(hello(1, Some(3), tcp("host-2:7000", "10.0.0.2:7000"))),
            Some(Refusal::OtherResponder { meant: 3, mine: 2 })
        );
        // A relay: the initiator dialed the relay (host-9), which reached
        // the relay's address.
        assert!(matches!(
            refused(hello(1, Some(2), tcp("host-9:7000", "10.0.0.9:7000"))),
            Some(Refusal::OtherEndpoint { .. })
        ));
        // The local socket answers only to its name.
        let local = ResponderSelf { reached_at: None, ..me.clone() };
        let h = hello(1, Some(2), Dialed { name: "orbite-9".into(), reached: None });
        assert!(Responder::on_hello(s.clone(), &local, h, nonce()).is_err());
        let h = hello(1, Some(2), tcp("orbite-2", "10.0.0.2:7000"));
        assert!(Responder::on_hello(s.clone(), &local, h, nonce()).is_err(), "a tcp hello on the local socket");
        // The initiator refuses its own epoch and an epoch it did not expect.
        let i = Initiator::new(s.clone(), 2, None, &tcp("host-2:7000", "10.0.0.2:7000"), nonce());
        let c = AuthChallenge { nonce: nonce(), responder_epoch: 2, mac: [0; AUTH_MAC] };
        assert_eq!(i.on_challenge(&c), Err(Refusal::OwnEpoch(2)));
        let i = Initiator::new(s, 1, Some(3), &tcp("host-2:7000", "10.0.0.2:7000"), nonce());
        assert_eq!(i.on_challenge(&c), Err(Refusal::UnexpectedEpoch { expected: 3, proven: 2 }));
    }
}
