//! The peer protocol as state machines (sans-IO, in the manner of
//! quinn-proto): they take bytes and events and say what to send and what
//! completed; they own no socket or thread and read no clock. `tcp` drives
//! them over sockets.

pub(crate) mod client;
pub(crate) mod open;
#[cfg(test)]
mod pair;
pub(crate) mod server;

use crate::transport::framebuf::{BufferBudget, FrameBuf, RESTING};
use crate::transport::sock::iov;
use crate::wire::{self, Header, Limits, WireError};

/// A frame coming in, header then body, into buffers of its own; both
/// machines read frames with it. With a budget (the listener's side), a
/// body beyond the resting size is charged while held; one the budget
/// cannot take is read and dropped, and the frame arrives marked
/// [`FrameIn::over_budget`] with no body.
pub(crate) struct FrameIn {
    head: [u8; wire::HEADER_LEN],
    /// Bytes of the header (while `header` is `None`) or of the body in.
    have: usize,
    header: Option<Header>,
    /// The body of the frame last completed (until the next header is in,
    /// or [`FrameIn::release`]).
    body: FrameBuf,
    /// The body in progress did not fit the budget: its bytes are dropped.
    dropping: bool,
    budget: Option<BufferBudget>,
}

impl FrameIn {
    pub fn new() -> Self {
        Self::with_budget(None)
    }

    /// A reader whose bodies beyond the resting size are charged to
    /// `budget`.
    pub fn with_budget(budget: Option<BufferBudget>) -> Self {
        FrameIn {
            head: [0; wire::HEADER_LEN],
            have: 0,
            header: None,
            body: FrameBuf::default(),
            dropping: false,
            budget,
        }
    }

    /// True when no byte of a frame is in.
    pub fn is_empty(&self) -> bool {
        self.header.is_none() && self.have == 0
    }

    /// The body of the frame last completed.
    pub fn body(&self) -> &[u8] {
        self.body.as_slice()
    }

    /// The body of the frame last completed, moved out.
    pub fn take_body(&mut self) -> Vec<u8> {
        self.body.take()
    }

    /// True when the frame last completed had a body the budget could
    /// not take (it was dropped; [`FrameIn::body`] is empty).
    pub fn over_budget(&self) -> bool {
        self.dropping
    }

    /// The body was used: its buffer goes back to its resting size.
    pub fn release(&mut self) {
        self.body.release();
    }

    /// Points `iovs` at the bytes the frame still needs.
    pub fn target(&mut self, iovs: &mut Vec<libc::iovec>) {
        let rest = match self.header {
            None => &mut self.head[self.have..],
            Some(h) if self.dropping => {
                // Dropped bytes land in the resting buffer, a piece at a time.
                let n = (h.body_len as usize - self.have).min(RESTING);
                let _ = self.body.set_len(n, None);
                self.body.as_mut_slice()
            }
            Some(_) => &mut self.body.as_mut_slice()[self.have..],
        };
        iovs.clear();
        iovs.push(iov(rest.as_mut_ptr() as u64, rest.len() as u64));
    }

    /// `n` bytes arrived into what [`FrameIn::target`] gave: the header of
    /// the frame once its body is in too (the body is then in
    /// [`FrameIn::body`]).
    pub fn received(&mut self, n: usize, limits: Limits) -> Result<Option<Header>, WireError> {
        self.have += n;
        match self.header {
            None => {
                if self.have < wire::HEADER_LEN {
                    return Ok(None);
                }
                let h = wire::decode_header(&self.head, limits)?;
                self.have = 0;
                self.dropping = self.body.set_len(h.body_len as usize, self.budget.as_ref()).is_err();
                if h.body_len > 0 {
                    self.header = Some(h);
                    return Ok(None);
                }
                Ok(Some(h))
            }
            Some(h) if self.have < h.body_len as usize => Ok(None),
            Some(_) => {
                self.have = 0;
                if self.dropping {
                    self.body.release();
                }
                Ok(self.header.take())
            }
        }
    }
}
