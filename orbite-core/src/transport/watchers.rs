//! Initiators subscribed to this engine's registration changes, each on a
//! watch connection of its own: every change is pushed to each of them as
//! it happens, as what changed since the last push that went out.
//!
//! The registering caller does no push itself: a change marks the
//! watchers dirty and, if they were not already, wakes a server thread (an
//! eventfd write), which pushes to every watcher at once what changed
//! since its last push, each delta encoded once per round for all the
//! watchers at the same version. A push never blocks: a watcher whose
//! socket is full is *behind*, skipped by those rounds (a flag check), and
//! tried again by the server's resync (a frame half sent is finished
//! first), with everything since the last version it took, so it
//! resynchronises once it reads again. What a watcher leaves unsent is
//! bounded: its socket's send buffer (set to [`PUSH_BUDGET`] at
//! subscription) plus at most one frame. Watchers are capped in total and
//! per peer address.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::charge::{Charge, Counter, Counters};
use crate::transport::proto::server::PUSH_BUDGET;
use crate::transport::sock::Stream;
use crate::wire::{self, Kind};

/// The changes after a registry version, in at most a budget of encoded
/// bytes (what the target side computes for a subscriber).
pub(crate) type ChangesSince<'a> = &'a dyn Fn(u64, usize) -> crate::segment::Delta;

/// How many watchers may subscribe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WatcherLimits {
    /// All together (`max_watchers`).
    pub total: usize,
    /// From one peer address (`max_watchers_per_address`; the local socket
    /// counts as one address).
    pub per_address: usize,
}

/// One subscribed watch connection.
pub(crate) struct Subscriber {
    /// The server's id of the connection.
    pub conn: u64,
    /// The peer's address (`None`: the local socket).
    pub peer: Option<IpAddr>,
    pub epoch: u64,
    pub request: u64,
    /// Largest delta to push (what the watcher accepts, at most
    /// [`PUSH_BUDGET`]).
    pub budget: usize,
    /// The connection's socket (it stays open while this holds it, even
    /// after the server closed the connection: a push then fails).
    pub socket: Arc<Stream>,
    push: Mutex<PushState>,
    /// Its socket was full at the last push.
    behind: AtomicBool,
    /// Counted in `watchers` while it lives.
    _counted: Charge,
}

/// What went out to one watcher. Its lock also keeps two pushes to one
/// socket from interleaving.
struct PushState {
    /// The registry version pushed so far (a frame half sent counts: it
    /// is finished before anything else goes out).
    pushed: u64,
    /// The frame being sent, and how much of it went out.
    frame: Vec<u8>,
    sent: usize,
}

impl Subscriber {
    /// Pushes what changed since the last push, if the registry moved past
    /// it (`now`); the first push (`first`) goes out even if nothing did:
    /// it confirms the subscription. A frame half sent before is finished
    /// first.
    fn push(&self, now: u64, deltas: &mut Deltas<'_>, first: bool) {
        let mut st = self.push.lock();
        if !st.frame.is_empty() && !self.send_rest(&mut st) {
            return;
        }
        if st.pushed >= now && !first {
            return;
        }
        let (version, delta) = deltas.after(st.pushed, self.budget);
        if version <= st.pushed && !first {
            return;
        }
        let mut body = Vec::new();
        wire::encode_changed(&mut body, self.epoch, st.pushed, delta);
        st.frame.extend_from_slice(&wire::encode_header(&wire::header(Kind::Changed, body.len(), 0, self.request)));
        st.frame.extend_from_slice(&body);
        st.sent = 0;
        if self.send_rest(&mut st) || st.sent > 0 {
            // Out, or committed: its rest goes before anything else.
            st.pushed = version;
        } else {
            // None of it went: it is made again, with what changed since.
            st.frame.clear();
        }
    }

    /// Sends what is left of the frame: true when all of it went out;
    /// false when the socket is full (the watcher is then behind, and the
    /// frame stays as it is).
    fn send_rest(&self, st: &mut PushState) -> bool {
        while st.sent < st.frame.len() {
            let rest = &st.frame[st.sent..];
            // SAFETY: a live buffer of `rest.len()` bytes.
            let n = unsafe {
                libc::send(
                    self.socket.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n <= 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // Full, or gone: behind until a resync finds room.
                self.behind.store(true, Ordering::Release);
                return false;
            }
            st.sent += n as usize;
        }
        st.frame.clear();
        if st.frame.capacity() > PUSH_BUDGET {
            st.frame.shrink_to(PUSH_BUDGET);
        }
        st.sent = 0;
        self.behind.store(false, Ordering::Release);
        true
    }
}

/// The deltas of one round of pushes, each computed and encoded once for
/// all the watchers at the same version (with the same budget).
pub(crate) struct Deltas<'a> {
    changes: ChangesSince<'a>,
    made: Vec<Made>,
}

/// One delta of a round: (since, budget), then the version it brings and
/// its encoding.
type Made = ((u64, usize), (u64, Vec<u8>));

impl<'a> Deltas<'a> {
    pub fn new(changes: ChangesSince<'a>) -> Self {
        Deltas { changes, made: Vec::new() }
    }

    /// What changed after `since` in at most `budget` bytes: the version it
    /// brings, and the encoded delta.
    fn after(&mut self, since: u64, budget: usize) -> (u64, &[u8]) {
        let i = match self.made.iter().position(|(k, _)| *k == (since, budget)) {
            Some(i) => i,
            None => {
                let d = (self.changes)(since, budget);
                self.made.push(((since, budget), (d.version, d.to_bytes())));
                self.made.len() - 1
            }
        };
        let (version, bytes) = &self.made[i].1;
        (*version, bytes)
    }
}

/// Every subscribed watcher of one server.
pub(crate) struct Watchers {
    /// A snapshot walked without holding a lock; replaced whole when a
    /// watcher comes or goes.
    subs: Mutex<Arc<Vec<Arc<Subscriber>>>>,
    /// How many there are (read by registering callers without the lock).
    count: AtomicUsize,
    /// A change waits to be pushed (a server thread was woken for it).
    dirty: AtomicBool,
    /// What wakes a server thread to push (in the server's epoll set).
    wake: crate::transport::reactor::Waker,
    limits: WatcherLimits,
    counters: Arc<Counters>,
}

/// Why a subscription is refused: a cap is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WatchRefused {
    #[error("this engine has {0} watchers (max_watchers)")]
    Total(usize),
    #[error("{0} watchers from one address (max_watchers_per_address)")]
    PerAddress(usize),
}

impl Watchers {
    pub fn new(limits: WatcherLimits, counters: Arc<Counters>) -> std::io::Result<Self> {
        let wake = crate::transport::reactor::Waker::new()?;
        Ok(Watchers {
            subs: Mutex::new(Arc::default()),
            count: AtomicUsize::new(0),
            dirty: AtomicBool::new(false),
            wake,
            limits,
            counters,
        })
    }

    /// The descriptor that becomes readable when a push round is due.
    pub fn wake_fd(&self) -> &crate::transport::reactor::Waker {
        &self.wake
    }

    /// Subscribes watch connection `conn` of `peer` on `socket` and brings
    /// it up to date; `Err(why)` when a cap is full (nothing changed).
    pub fn subscribe(
        &self,
        conn: u64,
        peer: Option<IpAddr>,
        (epoch, request, budget, since): (u64, u64, usize, u64),
        socket: Arc<Stream>,
        now: u64,
        changes: ChangesSince<'_>,
    ) -> Result<(), WatchRefused> {
        let sub = {
            let mut subs = self.subs.lock();
            let others = subs.iter().filter(|x| x.conn != conn);
            if others.clone().count() >= self.limits.total {
                return Err(WatchRefused::Total(self.limits.total));
            }
            if others.filter(|x| x.peer == peer).count() >= self.limits.per_address {
                return Err(WatchRefused::PerAddress(self.limits.per_address));
            }
            // What the watcher leaves unsent stays in its socket, bounded.
            crate::transport::sock::set_send_buffer(&socket, PUSH_BUDGET);
            let sub = Arc::new(Subscriber {
                conn,
                peer,
                epoch,
                request,
                budget,
                socket,
                push: Mutex::new(PushState { pushed: since, frame: Vec::new(), sent: 0 }),
                behind: AtomicBool::new(false),
                _counted: Charge::unlimited(&self.counters, Counter::Watchers, 1),
            });
            let mut next: Vec<Arc<Subscriber>> = subs.iter().filter(|x| x.conn != conn).cloned().collect();
            next.push(sub.clone());
            self.count.store(next.len(), Ordering::Release);
            *subs = Arc::new(next);
            sub
        };
        sub.push(now, &mut Deltas::new(changes), true);
        Ok(())
    }

    /// Subscriptions now.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// The registry changed (a registering caller): a push round is due.
    /// Costs an atomic load with no watcher, an atomic swap while a round
    /// is already due, else one eventfd write: never a push.
    pub fn changed(&self) {
        if self.count.load(Ordering::Acquire) == 0 || self.dirty.swap(true, Ordering::SeqCst) {
            return;
        }
        self.wake.wake();
    }

    /// A server thread's push round (the wake fd was readable): every
    /// watcher not behind gets what changed since its last push, up to the
    /// registry's version (`version`, read once the round began: a change
    /// after that wakes another round).
    pub fn push_round(&self, version: &dyn Fn() -> u64, changes: ChangesSince<'_>) {
        self.wake.drain();
        self.dirty.store(false, Ordering::SeqCst);
        self.push_to(false, version(), changes);
    }

    /// The server's resync, every few milliseconds while there are
    /// watchers: tries every watcher that is behind again.
    pub fn resync(&self, version: u64, changes: ChangesSince<'_>) {
        self.push_to(true, version, changes);
    }

    /// Pushes what changed up to `version` to every watcher that is
    /// `behind` (or every one that is not), each delta made once.
    fn push_to(&self, behind: bool, version: u64, changes: ChangesSince<'_>) {
        let subs = self.subs.lock().clone();
        let mut deltas = Deltas::new(changes);
        for sub in subs.iter().filter(|s| s.behind.load(Ordering::Acquire) == behind) {
            sub.push(version, &mut deltas, false);
        }
    }

    /// Connection `conn` is gone.
    pub fn forget(&self, conn: u64) {
        let gone = {
            let mut subs = self.subs.lock();
            if !subs.iter().any(|x| x.conn == conn) {
                return;
            }
            let next: Vec<Arc<Subscriber>> = subs.iter().filter(|x| x.conn != conn).cloned().collect();
            self.count.store(next.len(), Ordering::Release);
            std::mem::replace(&mut *subs, Arc::new(next))
        };
        drop(gone); // outside the lock
    }
}
