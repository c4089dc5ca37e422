//! Buffers of the frames peers send and of the replies sent back: what a
//! connection holds between exchanges is a few KiB, whatever it carried.
//!
//! Up to [`RESTING`] bytes stay in a heap vector the buffer keeps. A
//! larger frame takes a heap vector up to [`MAPPED_FROM`] bytes, and a
//! private anonymous mapping beyond, given back (unmapped: the memory
//! returns to the system at once, which a freed heap block may not) by
//! [`FrameBuf::release`] once the exchange is done. Everything beyond
//! `RESTING` is charged while held to a [`BufferBudget`] when the buffer
//! has one (the listener's connections: `max_frame_buffer_bytes`), so a
//! peer beyond the total is refused instead of growing the process.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::charge::{Charge, Counter, Counters};
use crate::types::{Exhausted, Resource};

/// Bytes a buffer keeps between exchanges.
pub(crate) const RESTING: usize = 4096;

/// From this size on, a buffer is a mapping of its own.
pub(crate) const MAPPED_FROM: usize = 64 << 10;

/// Where the bytes of buffers beyond their resting size are charged.
#[derive(Debug, Clone)]
pub(crate) struct BufferBudget {
    pub counters: Arc<Counters>,
    /// `max_frame_buffer_bytes`.
    pub limit: u64,
}

impl BufferBudget {
    fn charge(&self, bytes: usize) -> Result<Charge, Exhausted> {
        Charge::limited(&self.counters, Counter::FrameBufferBytes, bytes as u64, Resource::FrameBufferBytes, self.limit)
    }
}

/// A private anonymous mapping.
struct Mapped {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and reached only through it.
unsafe impl Send for Mapped {}

impl Mapped {
    fn new(len: usize) -> Option<Mapped> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(p.cast()).map(|ptr| Mapped { ptr, len })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A frame's (or a reply's) bytes.
#[derive(Default)]
pub(crate) struct FrameBuf {
    /// The bytes, when not mapped (its length is the buffer's).
    vec: Vec<u8>,
    /// The bytes of a large buffer, with its length in use.
    map: Option<(Mapped, usize)>,
    /// What is held beyond the resting size, while it is held.
    charge: Option<Charge>,
}

impl FrameBuf {
    /// Sizes the buffer to `len` bytes (their values unspecified), charging
    /// what exceeds [`RESTING`] to `budget`. Refused (the buffer then holds
    /// nothing) when the budget is full, or a mapping cannot be made.
    pub fn set_len(&mut self, len: usize, budget: Option<&BufferBudget>) -> Result<(), Exhausted> {
        self.release();
        if len > RESTING {
            if let Some(b) = budget {
                self.charge = Some(b.charge(len)?);
            }
        }
        if len >= MAPPED_FROM {
            match Mapped::new(len) {
                Some(m) => self.map = Some((m, len)),
                None => {
                    self.charge = None;
                    return Err(Exhausted { resource: Resource::FrameBufferBytes, limit: 0, requested: len as u64 });
                }
            }
        } else {
            self.vec.resize(len, 0);
        }
        Ok(())
    }

    /// Sizes the buffer to hold `parts` one after the other, and fills it.
    pub fn set(&mut self, parts: &[&[u8]], budget: Option<&BufferBudget>) -> Result<(), Exhausted> {
        let len = parts.iter().map(|p| p.len()).sum();
        self.set_len(len, budget)?;
        let mut at = 0;
        let out = self.as_mut_slice();
        for p in parts {
            out[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.map {
            // SAFETY: a live mapping of at least `len` bytes owned by this
            // value; `&self` keeps it alive and unchanged.
            Some((m, len)) => unsafe { std::slice::from_raw_parts(m.ptr.as_ptr(), *len) },
            None => &self.vec,
        }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.map {
            // SAFETY: as in `as_slice`; `&mut self` makes the access unique.
            Some((m, len)) => unsafe { std::slice::from_raw_parts_mut(m.ptr.as_ptr(), *len) },
            None => &mut self.vec,
        }
    }

    /// The bytes, moved out (the buffer is then empty).
    pub fn take(&mut self) -> Vec<u8> {
        let out = match &self.map {
            Some(_) => self.as_slice().to_vec(),
            None => std::mem::take(&mut self.vec),
        };
        self.release();
        out
    }

    /// Empties the buffer: a mapping goes back to the system, a heap
    /// vector keeps at most [`RESTING`] bytes, the charge ends.
    pub fn release(&mut self) {
        self.map = None;
        self.vec.clear();
        if self.vec.capacity() > RESTING {
            self.vec.shrink_to(RESTING);
        }
        self.charge = None;
    }

    /// Bytes this buffer holds in memory (capacity, not length).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.vec.capacity() + self.map.as_ref().map_or(0, |(m, _)| m.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_charged_while_held_and_given_back() {
        let counters = Arc::new(Counters::default());
        let budget = BufferBudget { counters: counters.clone(), limit: 3 << 20 };
        let mut a = FrameBuf::default();
        a.set(&[b"head", &[7u8; 100]], Some(&budget)).unwrap();
        assert_eq!((a.as_slice().len(), &a.as_slice()[..4]), (104, &b"head"[..]));
        assert_eq!(counters.get(Counter::FrameBufferBytes), 0, "small buffers are not charged");
        for len in [RESTING + 1, MAPPED_FROM, 1 << 20] {
            a.set_len(len, Some(&budget)).unwrap();
            a.as_mut_slice()[len - 1] = 9;
            assert_eq!(a.as_slice().len(), len);
            assert_eq!(counters.get(Counter::FrameBufferBytes), len as u64);
            a.release();
            assert_eq!(counters.get(Counter::FrameBufferBytes), 0);
            assert!(a.held() <= RESTING, "a released buffer keeps {} bytes", a.held());
        }
        // Beyond the budget: refused, nothing held or charged.
        let mut b = FrameBuf::default();
        b.set_len(2 << 20, Some(&budget)).unwrap();
        let e = a.set_len(2 << 20, Some(&budget)).unwrap_err();
        assert_eq!(e.resource, Resource::FrameBufferBytes);
        assert!(a.held() <= RESTING);
        assert_eq!(counters.get(Counter::FrameBufferBytes), 2 << 20, "only b's charge");
        assert_eq!(b.take().len(), 2 << 20);
        assert_eq!(counters.get(Counter::FrameBufferBytes), 0);
        // Without a budget (the initiator's own buffers): never refused.
        a.set_len(8 << 20, None).unwrap();
        assert_eq!(counters.get(Counter::FrameBufferBytes), 0);
    }
}
