//! The same-host notification inbox: a ring of notification envelopes in a
//! shared mapping, with a futex word to sleep on.
//!
//! Each listening engine owns one inbox (a shared allocation, a sealed
//! memfd, named in its segment descriptor). Proven same-host senders are
//! handed it over the local socket, map it and append envelopes
//! under a spin lock held for one copy; the owner is the only consumer.
//! Positions grow monotonically; an entry may wrap around the ring's end.
//! The consumer treats the ring as untrusted input: an entry that does not
//! parse drops the rest of the ring, never more.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::codec::Reader;

const MAGIC: u64 = u64::from_be_bytes(*b"ORBTINB2");
/// Bytes before the ring.
pub(crate) const HEADER: usize = 128;
/// Ring bytes of every inbox.
pub(crate) const CAPACITY: usize = 1 << 20;

#[repr(C)]
struct Header {
    magic: u64,
    epoch: u64,
    capacity: u64,
    /// The owner's limits: largest payload, and bytes it lets wait.
    max_payload: u64,
    budget: u64,
    head: AtomicU64,
    tail: AtomicU64,
    lock: AtomicU32,
    futex: AtomicU32,
    /// Deregistrations by the owner so far: a same-host borrower whose
    /// loan predates a change asks again before its next one-sided post.
    fences: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

/// One envelope read from an inbox.
pub(crate) struct Envelope {
    pub sender_epoch: u64,
    pub target_epoch: u64,
    pub sender_endpoint: String,
    pub payload: Vec<u8>,
}

/// Why an append did not happen (the sender then uses TCP).
#[derive(Debug)]
pub(crate) enum AppendError {
    Full,
    Busy,
}

/// A view of an inbox mapping (owner's or a sender's).
pub(crate) struct Inbox {
    base: *mut u8,
    len: usize,
}

// SAFETY: the header is accessed only through atomics and the ring only
// under the shared spin lock (producers) or by the single consumer.
unsafe impl Send for Inbox {}
// SAFETY: as above.
unsafe impl Sync for Inbox {}

impl Inbox {
    /// Initialises a fresh, zeroed mapping of `HEADER + CAPACITY` bytes.
    ///
    /// # Safety
    /// `base..base + len` must be a live, writable shared mapping, aligned
    /// to a page, that outlives the returned view.
    pub unsafe fn create(base: *mut u8, len: usize, epoch: u64, max_payload: u64, budget: u64) -> Inbox {
        let inbox = Inbox { base, len };
        let h = inbox.header();
        // SAFETY: the caller owns the fresh mapping; nobody else has it yet.
        unsafe {
            let raw = base as *mut Header;
            (*raw).epoch = epoch;
            (*raw).capacity = (len - HEADER) as u64;
            (*raw).max_payload = max_payload;
            (*raw).budget = budget;
            (*raw).magic = MAGIC;
        }
        h.head.store(0, Ordering::Release);
        h.tail.store(0, Ordering::Release);
        inbox
    }

    /// Opens a peer's inbox; checks its header against the peer's epoch.
    ///
    /// # Safety
    /// As for `create`; the mapping is the peer's inbox file.
    pub unsafe fn open(base: *mut u8, len: usize, epoch: u64) -> Option<Inbox> {
        if len < HEADER + 4096 {
            return None;
        }
        // SAFETY: in bounds (len >= HEADER); plain reads of fixed fields.
        let (magic, e, cap) = unsafe {
            let raw = base as *const Header;
            (std::ptr::read_volatile(&(*raw).magic), std::ptr::read_volatile(&(*raw).epoch), (*raw).capacity)
        };
        // The file may be longer than the ring (rounded to pages): the
        // header's capacity decides, and must fit in the mapping.
        let fits = cap >= 4096 && cap as usize <= len - HEADER;
        (magic == MAGIC && e == epoch && fits).then(|| Inbox { base, len: HEADER + cap as usize })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER bytes and page aligned.
        unsafe { &*(self.base as *const Header) }
    }

    fn capacity(&self) -> u64 {
        (self.len - HEADER) as u64
    }

    fn ring(&self) -> *mut u8 {
        self.base.wrapping_add(HEADER)
    }

    /// Deregistrations the owner announced so far.
    pub fn fences(&self) -> u64 {
        self.header().fences.load(Ordering::Acquire)
    }

    /// Announces a deregistration (owner only).
    pub fn announce_fence(&self) {
        self.header().fences.fetch_add(1, Ordering::AcqRel);
    }

    /// The futex word: it changes whenever something may have arrived.
    pub fn word(&self) -> u32 {
        self.header().futex.load(Ordering::Acquire)
    }

    /// Announces an arrival to sleepers.
    pub fn wake(&self) {
        let h = self.header();
        h.futex.fetch_add(1, Ordering::AcqRel);
        // SAFETY: a futex wake on a word of a live shared mapping.
        unsafe {
            libc::syscall(libc::SYS_futex, &h.futex as *const AtomicU32, libc::FUTEX_WAKE, i32::MAX, 0, 0, 0);
        }
    }

    /// Sleeps until the word moves from `seen` or `timeout` passes.
    pub fn sleep(&self, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a futex wait on a word of a live shared mapping.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                &self.header().futex as *const AtomicU32,
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                0,
                0,
            );
        }
    }

    fn copy_in(&self, pos: u64, bytes: &[u8]) {
        let cap = self.capacity();
        let at = (pos % cap) as usize;
        let first = bytes.len().min(cap as usize - at);
        // SAFETY: both pieces are inside the ring; producers write only
        // the free region they reserved under the lock.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ring().add(at), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.ring(), bytes.len() - first);
        }
    }

    fn copy_out(&self, pos: u64, out: &mut [u8]) {
        let cap = self.capacity();
        let at = (pos % cap) as usize;
        let first = out.len().min(cap as usize - at);
        // SAFETY: both pieces are inside the ring; the consumer reads only
        // published entries (below `tail`).
        unsafe {
            std::ptr::copy_nonoverlapping(self.ring().add(at), out.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.ring(), out.as_mut_ptr().add(first), out.len() - first);
        }
    }

    /// Appends one envelope (sender side) and wakes the owner.
    pub fn append(&self, env: &Envelope) -> Result<(), AppendError> {
        let ep = env.sender_endpoint.as_bytes();
        let body = 8 + 8 + 2 + ep.len() + 4 + env.payload.len();
        let need = (4 + body).next_multiple_of(8) as u64;
        let h = self.header();
        // The owner's limits travel in the header: what it would refuse over
        // TCP it must not find in its inbox either.
        // SAFETY: plain reads of fixed header fields.
        let (max_payload, budget) =
            unsafe { (std::ptr::read_volatile(&h.max_payload), std::ptr::read_volatile(&h.budget)) };
        let room = self.capacity().min(budget);
        if need > self.capacity() / 2 || env.payload.len() as u64 > max_payload || need > room {
            return Err(AppendError::Full);
        }
        let start = Instant::now();
        while h.lock.compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            if start.elapsed() > Duration::from_millis(1) {
                return Err(AppendError::Busy); // a stuck or dead holder: use TCP
            }
            std::hint::spin_loop();
        }
        let (head, tail) = (h.head.load(Ordering::Acquire), h.tail.load(Ordering::Acquire));
        // The positions come from a mapping others write: checked.
        let used = tail.checked_sub(head).and_then(|u| u.checked_add(need));
        let Some(new_tail) = tail.checked_add(need).filter(|_| used.is_some_and(|u| u <= room)) else {
            h.lock.store(0, Ordering::Release);
            return Err(AppendError::Full);
        };
        let mut e = Vec::with_capacity(need as usize);
        e.extend_from_slice(&(need as u32).to_le_bytes());
        e.extend_from_slice(&env.sender_epoch.to_le_bytes());
        e.extend_from_slice(&env.target_epoch.to_le_bytes());
        e.extend_from_slice(&(ep.len() as u16).to_le_bytes());
        e.extend_from_slice(ep);
        e.extend_from_slice(&(env.payload.len() as u32).to_le_bytes());
        e.extend_from_slice(&env.payload);
        e.resize(need as usize, 0);
        self.copy_in(tail, &e);
        h.tail.store(new_tail, Ordering::Release);
        h.lock.store(0, Ordering::Release);
        self.wake();
        Ok(())
    }

    /// True if an envelope is waiting (owner side).
    pub fn has_entries(&self) -> bool {
        let h = self.header();
        h.head.load(Ordering::Acquire) != h.tail.load(Ordering::Acquire)
    }

    /// Takes waiting envelopes in order (owner side, one consumer), at most
    /// `max_payload` bytes of payload each, until `out` declines one (it
    /// stays for a later drain).
    pub fn drain(&self, max_payload: usize, mut out: impl FnMut(Envelope) -> bool) {
        let h = self.header();
        let mut head = h.head.load(Ordering::Acquire);
        let tail = h.tail.load(Ordering::Acquire);
        let cap = self.capacity();
        // A ring never holds more than its capacity: a tail beyond that (or
        // behind the head) is a sender's corruption, and what lies between
        // would be old entries read again. Drop it all.
        if tail < head || tail - head > cap {
            h.head.store(tail, Ordering::Release);
            return;
        }
        while head < tail {
            let mut len = [0u8; 4];
            self.copy_out(head, &mut len);
            let len = u32::from_le_bytes(len) as u64;
            let sane = len >= 32 && len % 8 == 0 && len <= cap / 2 && head.checked_add(len).is_some_and(|e| e <= tail);
            let env = sane.then(|| {
                let mut e = vec![0u8; len as usize];
                self.copy_out(head, &mut e);
                parse(&e, max_payload)
            });
            let Some(env) = env.flatten() else {
                head = tail; // corrupt: drop the rest, never read past it
                break;
            };
            if !out(env) {
                break;
            }
            head += len;
        }
        h.head.store(head, Ordering::Release);
    }
}

fn parse(e: &[u8], max_payload: usize) -> Option<Envelope> {
    let mut r = Reader::new(e);
    r.u32().ok()?; // the entry's length, checked by the caller
    let sender_epoch = r.u64().ok()?;
    let target_epoch = r.u64().ok()?;
    let ep_len = r.u16().ok()? as usize;
    let ep = std::str::from_utf8(r.take(ep_len).ok()?).ok()?.to_owned();
    let n = r.u32().ok()? as usize;
    if n > max_payload {
        return None;
    }
    let payload = r.take(n).ok()?.to_vec();
    Some(Envelope { sender_epoch, target_epoch, sender_endpoint: ep, payload })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(len: usize) -> (Vec<u64>, *mut u8) {
        let mut v = vec![0u64; len / 8];
        let p = v.as_mut_ptr() as *mut u8;
        (v, p)
    }

    #[test]
    fn append_drain_wraps_and_keeps_order_and_bytes() {
        let len = HEADER + 4096;
        let (_keep, base) = mapping(len);
        // SAFETY: a zeroed, aligned buffer that outlives both views.
        let owner = unsafe { Inbox::create(base, len, 7, 1 << 20, 1 << 20) };
        // SAFETY: as above.
        let sender = unsafe { Inbox::open(base, len, 7) }.unwrap();
        // SAFETY: as above.
        assert!(unsafe { Inbox::open(base, len, 8) }.is_none(), "another epoch");
        let mut got = Vec::new();
        for round in 0..200u32 {
            let payload: Vec<u8> = (0..(round % 300)).map(|i| (i ^ round) as u8).collect();
            let env =
                Envelope { sender_epoch: 1, target_epoch: 7, sender_endpoint: "h:1".into(), payload: payload.clone() };
            sender.append(&env).unwrap();
            owner.drain(1 << 20, |e| {
                got.push(e.payload);
                true
            });
            assert_eq!(got.pop().unwrap(), payload);
        }
        // Fill up: appends fail with Full, never overwrite.
        let big = Envelope { sender_epoch: 1, target_epoch: 7, sender_endpoint: String::new(), payload: vec![1; 1000] };
        let mut n = 0;
        while sender.append(&big).is_ok() {
            n += 1;
        }
        assert!(n >= 3);
        let mut count = 0;
        owner.drain(1 << 20, |e| {
            assert_eq!(e.payload, vec![1; 1000]);
            count += 1;
            true
        });
        assert_eq!(count, n);
        assert!(!owner.has_entries());
    }

    #[test]
    fn hostile_positions_never_wrap_the_arithmetic() {
        let len = HEADER + 4096;
        let (_keep, base) = mapping(len);
        // SAFETY: as in the test above.
        let owner = unsafe { Inbox::create(base, len, 1, 1 << 20, 1 << 20) };
        let env = Envelope { sender_epoch: 1, target_epoch: 1, sender_endpoint: "x".into(), payload: vec![9; 10] };
        let h = owner.header();
        // Head ahead of tail, tail at the top of the range, both: an append
        // is refused and a drain reads nothing (debug builds would panic on
        // an overflow, release builds would wrap).
        for (head, tail) in [(100, 50), (0, u64::MAX - 8), (u64::MAX - 8, u64::MAX - 8), (u64::MAX, 5)] {
            h.head.store(head, Ordering::Release);
            h.tail.store(tail, Ordering::Release);
            assert!(owner.append(&env).is_err(), "append with head {head} tail {tail}");
            owner.drain(1 << 20, |_| panic!("an envelope out of hostile positions"));
        }
    }

    /// Found by the `inbox` fuzz target: a tail rewritten far past the head
    /// made the owner read the ring's old entries again, about 2^30 times.
    #[test]
    fn a_tail_beyond_the_capacity_replays_nothing() {
        let len = HEADER + 4096;
        let (_keep, base) = mapping(len);
        // SAFETY: as in the test above.
        let owner = unsafe { Inbox::create(base, len, 1, 1 << 20, 1 << 20) };
        let env = Envelope { sender_epoch: 1, target_epoch: 1, sender_endpoint: "x".into(), payload: vec![3; 900] };
        while owner.append(&env).is_ok() {}
        let mut taken = 0;
        owner.drain(1 << 20, |_| {
            taken += 1;
            true
        });
        assert!(taken >= 3);
        let h = owner.header();
        let head = h.head.load(Ordering::Acquire);
        h.tail.store(head + (1 << 40), Ordering::Release);
        owner.drain(1 << 20, |_| panic!("an envelope taken already came back"));
        assert!(!owner.has_entries());
        owner.append(&env).unwrap();
        let mut again = 0;
        owner.drain(1 << 20, |_| {
            again += 1;
            true
        });
        assert_eq!(again, 1, "the inbox works again");
    }

    /// Found by the `inbox` fuzz target: a sender that wrote a capacity near
    /// `u64::MAX` into the header overflowed the view's length before the
    /// capacity check refused it.
    #[test]
    fn a_hostile_capacity_in_the_header_is_refused() {
        let len = HEADER + 4096;
        let (_keep, base) = mapping(len);
        // SAFETY: as in the test above.
        let owner = unsafe { Inbox::create(base, len, 1, 1 << 20, 1 << 20) };
        for cap in [u64::MAX, u64::MAX - HEADER as u64 + 1, (len - HEADER) as u64 + 1, 4095, 0] {
            // SAFETY: the capacity field of the header, inside the buffer.
            unsafe { (*(base as *mut Header)).capacity = cap };
            // SAFETY: as above.
            assert!(unsafe { Inbox::open(base, len, 1) }.is_none(), "capacity {cap}");
        }
        // SAFETY: as above.
        unsafe { (*(base as *mut Header)).capacity = (len - HEADER) as u64 };
        // SAFETY: as above.
        let sender = unsafe { Inbox::open(base, len, 1) }.unwrap();
        let env = Envelope { sender_epoch: 1, target_epoch: 1, sender_endpoint: "x".into(), payload: vec![1; 8] };
        sender.append(&env).unwrap();
        assert!(owner.has_entries());
    }

    #[test]
    fn a_corrupt_ring_is_dropped_without_reading_past_tail() {
        let len = HEADER + 4096;
        let (_keep, base) = mapping(len);
        // SAFETY: as in the test above.
        let owner = unsafe { Inbox::create(base, len, 1, 1 << 20, 1 << 20) };
        let env = Envelope { sender_epoch: 1, target_epoch: 1, sender_endpoint: "x".into(), payload: vec![9; 10] };
        owner.append(&env).unwrap();
        // Corrupt the length field of the entry.
        // SAFETY: inside the buffer.
        unsafe { *base.add(HEADER) = 0xFF };
        let mut seen = 0;
        owner.drain(1 << 20, |_| {
            seen += 1;
            true
        });
        assert_eq!(seen, 0);
        assert!(!owner.has_entries());
        owner.append(&env).unwrap();
        owner.drain(1 << 20, |_| {
            seen += 1;
            true
        });
        assert_eq!(seen, 1, "the inbox works again");
        // The owner's limits are enforced at append.
        let big = Envelope { sender_epoch: 1, target_epoch: 1, sender_endpoint: "x".into(), payload: vec![0; 2000] };
        // SAFETY: as above.
        let strict = unsafe { Inbox::create(base, len, 1, 1000, 1 << 20) };
        assert!(matches!(strict.append(&big), Err(AppendError::Full)));
        // A declined envelope stays for the next drain.
        strict.append(&env).unwrap();
        strict.drain(1 << 20, |_| false);
        assert!(strict.has_entries());
    }
}
