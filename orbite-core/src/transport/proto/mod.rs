//! The peer protocol as state machines (sans-IO, in the manner of
//! quinn-proto): they take bytes and events and say what to send and what
//! completed; they own no socket or thread and read no clock. `tcp` drives
//! them over sockets.

pub(crate) mod client;
pub(crate) mod server;

use crate::transport::sock::iov;
use crate::wire::{self, Header, Limits, WireError};

/// A frame coming in, header then body, into buffers of its own; both
/// machines read frames with it.
pub(crate) struct FrameIn {
    head: [u8; wire::HEADER_LEN],
    /// Bytes of the header (while `header` is `None`) or of the body in.
    have: usize,
    header: Option<Header>,
    /// The body of the frame last completed (until the next header is in).
    pub body: Vec<u8>,
}

impl FrameIn {
    pub fn new() -> Self {
        FrameIn { head: [0; wire::HEADER_LEN], have: 0, header: None, body: Vec::new() }
    }

    /// True when no byte of a frame is in.
    pub fn is_empty(&self) -> bool {
        self.header.is_none() && self.have == 0
    }

    /// Points `iovs` at the bytes the frame still needs.
    pub fn target(&mut self, iovs: &mut Vec<libc::iovec>) {
        let rest = match self.header {
            None => &mut self.head[self.have..],
            Some(_) => &mut self.body[self.have..],
        };
        iovs.clear();
        iovs.push(iov(rest.as_mut_ptr() as u64, rest.len() as u64));
    }

    /// `n` bytes arrived into what [`FrameIn::target`] gave: the header of
    /// the frame once its body is in too (the body is then in `body`).
    pub fn received(&mut self, n: usize, limits: Limits) -> Result<Option<Header>, WireError> {
        self.have += n;
        match self.header {
            None => {
                if self.have < wire::HEADER_LEN {
                    return Ok(None);
                }
                let h = wire::decode_header(&self.head, limits)?;
                self.body.clear();
                self.body.resize(h.body_len as usize, 0);
                self.have = 0;
                if h.body_len > 0 {
                    self.header = Some(h);
                    return Ok(None);
                }
                Ok(Some(h))
            }
            Some(_) if self.have < self.body.len() => Ok(None),
            Some(_) => {
                self.have = 0;
                Ok(self.header.take())
            }
        }
    }
}
