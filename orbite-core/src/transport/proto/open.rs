//! The initiator's exchanges on a fresh connection before it carries
//! work, as a machine: the authentication handshake, the authoritative
//! Describe, and a watch's subscription. Bytes in, bytes out: the driver
//! sends [`Opening::to_send`], fills [`Opening::want`] and reports what
//! came with [`Opening::received`] until it says how the exchange ended.
//! No socket, thread or clock (the driver bounds the time).

use crate::segment::{Delta, SegmentDescriptor};
use crate::transport::auth::Initiator;
use crate::transport::peer_errors::OpenError;
use crate::wire::{self, Header, Kind, Limits, Message, RemoteStatus, WireError};

/// One exchange.
pub(crate) enum Exchange {
    /// The handshake toward the endpoint the initiator dialed.
    Authenticate(Initiator),
    /// The Describe: the target's descriptor, of at most `max_descriptor`
    /// bytes, under the `expected` epoch if the initiator knows it.
    Describe { my_epoch: u64, expected: Option<u64>, max_descriptor: usize },
    /// A watch's subscription to the changes after registry version
    /// `since` of the target of `epoch`, each push at most `max_reply`.
    Watch { epoch: u64, since: u64, max_reply: u64 },
}

/// How an exchange ended well.
#[derive(Debug)]
pub(crate) enum Opened {
    /// The responder proved the secret, and this epoch.
    Proved(u64),
    /// The target's descriptor, and the wire minor its reply came with.
    Described(SegmentDescriptor, u8),
    /// What changed after the version subscribed from: `(base, delta)`.
    Watching(u64, Delta),
    /// The target has all the watchers it takes.
    WatchersFull,
}

/// Where the handshake stands.
enum Stage {
    /// The request is out; its reply is awaited.
    Reply,
    /// The handshake's proof is out; the AuthOk is awaited.
    Proof(u64),
}

/// One exchange on one connection.
pub(crate) struct Opening {
    exchange: Exchange,
    stage: Stage,
    out: Vec<u8>,
    sent: usize,
    head: [u8; wire::HEADER_LEN],
    header: Option<Header>,
    body: Vec<u8>,
    have: usize,
    limits: Limits,
}

impl Opening {
    /// Starts `exchange` (its request goes first); replies are read
    /// within `limits`.
    pub fn new(exchange: Exchange, limits: Limits) -> Opening {
        let mut body = Vec::new();
        let (kind, limits) = match &exchange {
            Exchange::Authenticate(hs) => {
                hs.hello().encode(&mut body);
                (Kind::AuthHello, Limits { max_body: wire::AUTH_MAX_BODY, max_data: 0 })
            }
            Exchange::Describe { my_epoch, expected, .. } => {
                wire::encode_describe(&mut body, *my_epoch, expected.unwrap_or(0));
                (Kind::Describe, limits)
            }
            Exchange::Watch { epoch, since, max_reply } => {
                wire::encode_watch(&mut body, *epoch, *since, *max_reply);
                (Kind::Watch, limits)
            }
        };
        let mut m = Opening {
            exchange,
            stage: Stage::Reply,
            out: Vec::new(),
            sent: 0,
            head: [0; wire::HEADER_LEN],
            header: None,
            body: Vec::new(),
            have: 0,
            limits,
        };
        m.queue(kind, &body);
        m
    }

    fn queue(&mut self, kind: Kind, body: &[u8]) {
        self.out.extend_from_slice(&wire::encode_header(&wire::header(kind, body.len(), 0, 1)));
        self.out.extend_from_slice(body);
    }

    /// Bytes to send.
    pub fn to_send(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    /// `n` bytes of [`Opening::to_send`] went out.
    pub fn sent(&mut self, n: usize) {
        self.sent += n;
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
    }

    /// Where the next bytes of the reply go (exactly what the reply still
    /// owes: never a byte of what follows it).
    pub fn want(&mut self) -> &mut [u8] {
        match self.header {
            None => &mut self.head[self.have..],
            Some(_) => &mut self.body[self.have..],
        }
    }

    /// `n` (> 0) bytes arrived into [`Opening::want`]: how the exchange
    /// ended, once it has.
    pub fn received(&mut self, n: usize) -> Result<Option<Opened>, OpenError> {
        self.have += n;
        let h = match self.header {
            None if self.have < wire::HEADER_LEN => return Ok(None),
            None => {
                let h = wire::decode_header(&self.head, self.limits).map_err(|e| self.malformed(e))?;
                self.have = 0;
                self.body = vec![0; h.body_len as usize];
                if h.body_len > 0 {
                    self.header = Some(h);
                    return Ok(None);
                }
                h
            }
            Some(h) if self.have < h.body_len as usize => return Ok(None),
            Some(h) => {
                self.header = None;
                self.have = 0;
                h
            }
        };
        let body = std::mem::take(&mut self.body);
        self.reply(&h, &body)
    }

    /// A reply that broke the protocol, in the words of its exchange.
    fn malformed(&self, e: WireError) -> OpenError {
        match self.exchange {
            Exchange::Authenticate(_) => OpenError::Protocol(format!("authentication: {e}")),
            _ => OpenError::Protocol(e.to_string()),
        }
    }

    fn reply(&mut self, h: &Header, body: &[u8]) -> Result<Option<Opened>, OpenError> {
        match &self.exchange {
            Exchange::Authenticate(hs) => {
                let want = match self.stage {
                    Stage::Reply => Kind::AuthChallenge,
                    Stage::Proof(_) => Kind::AuthOk,
                };
                match h.kind {
                    k if k == want && h.data_len == 0 => {}
                    Kind::Error => {
                        let detail = match Message::decode(h, body) {
                            Ok(Message::Error { detail, .. }) => detail,
                            _ => String::new(),
                        };
                        return Err(OpenError::Unauthenticated(format!("the peer refused: {detail}")));
                    }
                    k => return Err(OpenError::Protocol(format!("unexpected {k:?} during authentication"))),
                }
                match self.stage {
                    Stage::Proof(epoch) => Ok(Some(Opened::Proved(epoch))),
                    Stage::Reply => {
                        let challenge = wire::AuthChallenge::decode(body).map_err(|e| self.malformed(e))?;
                        let proof =
                            hs.on_challenge(&challenge).map_err(|why| OpenError::Unauthenticated(why.to_string()))?;
                        self.stage = Stage::Proof(challenge.responder_epoch);
                        self.queue(Kind::AuthProof, &proof);
                        Ok(None)
                    }
                }
            }
            Exchange::Describe { my_epoch, expected, max_descriptor } => {
                if h.kind == Kind::Error {
                    return Err(match Message::decode(h, body) {
                        Ok(Message::Error { status: RemoteStatus::Unauthenticated, detail: d }) => {
                            OpenError::Unauthenticated(format!(
                                "the peer requires authentication (auth.secret_file): {d}"
                            ))
                        }
                        Ok(Message::Error { status, detail: d }) => {
                            OpenError::Protocol(format!("describe refused: {status:?}: {d}"))
                        }
                        Ok(m) => OpenError::Protocol(WireError::OutOfPlace(m.kind()).to_string()),
                        Err(e) => OpenError::Protocol(e.to_string()),
                    });
                }
                if h.kind != Kind::DescribeReply || h.data_len != 0 || h.request != 1 {
                    return Err(OpenError::Protocol(format!("unexpected {:?} reply to describe", h.kind)));
                }
                let descriptor =
                    SegmentDescriptor::decode(body, *max_descriptor).map_err(|e| OpenError::Protocol(e.to_string()))?;
                if let Some(expected) = expected.filter(|e| *e != descriptor.epoch) {
                    return Err(OpenError::EpochMismatch { expected, found: descriptor.epoch });
                }
                if descriptor.epoch == *my_epoch {
                    return Err(OpenError::OwnEngine);
                }
                Ok(Some(Opened::Described(descriptor, h.minor)))
            }
            Exchange::Watch { epoch, .. } => {
                if let Ok(Message::Error { status: RemoteStatus::ResourceExhausted, .. }) = Message::decode(h, body) {
                    return Ok(Some(Opened::WatchersFull));
                }
                let (base, delta) = changes_of(h, body, *epoch).map_err(|e| OpenError::Protocol(e.to_string()))?;
                Ok(Some(Opened::Watching(base, delta)))
            }
        }
    }
}

/// Why a frame on the watch connection is refused (the link then stops
/// trusting what it was told, and asks).
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchFrameError {
    #[error("unexpected {0:?} on the watch connection")]
    Unexpected(Kind),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("changes of another epoch")]
    OtherEpoch,
}

/// Decodes one Changed frame of the subscription (request 1) for `epoch`.
pub(crate) fn changes_of(h: &Header, body: &[u8], epoch: u64) -> Result<(u64, Delta), WatchFrameError> {
    if h.request != 1 || h.kind != Kind::Changed {
        return Err(WatchFrameError::Unexpected(h.kind));
    }
    let Message::Changed { target_epoch, base, delta } = Message::decode(h, body)? else {
        return Err(WatchFrameError::Unexpected(h.kind));
    };
    let delta = Delta::decode(delta)?;
    if target_epoch != epoch {
        return Err(WatchFrameError::OtherEpoch);
    }
    Ok((base, delta))
}
