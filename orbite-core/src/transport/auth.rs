//! Mutual authentication of peer connections: a shared secret (the
//! `auth.secret_file` of both engines), proven by each side with
//! HMAC-SHA256 over fresh nonces from both sides and both epochs, before
//! any other frame. What is authenticated: that the other end knows the
//! secret, and the epochs both sides claim. What is not: payload
//! confidentiality or integrity after the handshake (frames travel in
//! clear; use a private network, or a tunnel, against eavesdroppers).
//!
//! The exchange, on every connection (data and watch):
//! 1. initiator: `AuthHello { nonce_i, epoch_i }`
//! 2. target: `AuthChallenge { nonce_t, epoch_t, mac_t }`, where
//!    `mac_t = HMAC(secret, "orbite auth v1 target" | nonce_i | nonce_t | epoch_i | epoch_t)`
//! 3. initiator checks `mac_t`, then `AuthProof { mac_i }` with the label
//!    "orbite auth v1 initiator"
//! 4. target checks `mac_i`, then `AuthOk`.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::{AUTH_MAC, AUTH_NONCE};

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

impl Secret {
    /// Reads a secret file: its bytes, without trailing white space; at
    /// least [`MIN_SECRET`] of them.
    pub fn load(path: &str) -> Result<Secret, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        if end < MIN_SECRET {
            return Err(format!("{path} holds {end} bytes; a secret needs at least {MIN_SECRET}"));
        }
        Ok(Secret(bytes[..end].to_vec()))
    }

    /// A secret from bytes (tests).
    #[cfg(test)]
    pub fn from_bytes(b: &[u8]) -> Secret {
        Secret(b.to_vec())
    }

    fn mac(&self, label: &[u8], nonce_i: &[u8], nonce_t: &[u8], epoch_i: u64, epoch_t: u64) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(nonce_i);
        m.update(nonce_t);
        m.update(&epoch_i.to_le_bytes());
        m.update(&epoch_t.to_le_bytes());
        m
    }

    /// The target's proof.
    pub fn target_proof(&self, h: &Handshake) -> [u8; AUTH_MAC] {
        self.mac(TARGET, &h.nonce_i, &h.nonce_t, h.epoch_i, h.epoch_t).finalize().into_bytes().into()
    }

    /// The initiator's proof.
    pub fn initiator_proof(&self, h: &Handshake) -> [u8; AUTH_MAC] {
        self.mac(INITIATOR, &h.nonce_i, &h.nonce_t, h.epoch_i, h.epoch_t).finalize().into_bytes().into()
    }

    /// Checks the target's proof (in constant time).
    pub fn check_target(&self, h: &Handshake, mac: &[u8]) -> bool {
        self.mac(TARGET, &h.nonce_i, &h.nonce_t, h.epoch_i, h.epoch_t).verify_slice(mac).is_ok()
    }

    /// Checks the initiator's proof (in constant time).
    pub fn check_initiator(&self, h: &Handshake, mac: &[u8]) -> bool {
        self.mac(INITIATOR, &h.nonce_i, &h.nonce_t, h.epoch_i, h.epoch_t).verify_slice(mac).is_ok()
    }
}

const TARGET: &[u8] = b"orbite auth v1 target";
const INITIATOR: &[u8] = b"orbite auth v1 initiator";

/// What one handshake binds: both nonces and both epochs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Handshake {
    pub nonce_i: [u8; AUTH_NONCE],
    pub nonce_t: [u8; AUTH_NONCE],
    pub epoch_i: u64,
    pub epoch_t: u64,
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
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_both_nonces_and_both_epochs() {
        let s = Secret::from_bytes(b"0123456789abcdef");
        let h = Handshake { nonce_i: nonce(), nonce_t: nonce(), epoch_i: 1, epoch_t: 2 };
        assert_ne!(h.nonce_i, h.nonce_t);
        let t = s.target_proof(&h);
        let i = s.initiator_proof(&h);
        assert_ne!(t, i, "the two directions differ");
        assert!(s.check_target(&h, &t) && s.check_initiator(&h, &i));
        assert!(!s.check_target(&h, &i), "an initiator's proof is no target's");
        let other = Secret::from_bytes(b"0123456789abcdeX");
        assert!(!other.check_target(&h, &t));
        for changed in [
            Handshake { epoch_i: 3, ..h },
            Handshake { epoch_t: 3, ..h },
            Handshake { nonce_i: nonce(), ..h },
            Handshake { nonce_t: nonce(), ..h },
        ] {
            assert!(!s.check_target(&changed, &t) && !s.check_initiator(&changed, &i));
        }
    }
}
