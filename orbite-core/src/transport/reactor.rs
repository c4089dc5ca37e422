//! The engine's one event loop ([`Reactor`]): a fixed set of threads, each
//! waiting on its own epoll set (edge-triggered) for the sources it owns:
//! the tcp server's listeners and accepted connections, the initiators'
//! link connections, the watch pushes and the pidfds of same-host peers.
//! A [`Source`] is a descriptor plus what to do when it is ready (a turn),
//! when its deadline passes, and when it is stopped; the loop keeps the
//! clocks (the epoll timeout is the nearest deadline), gives each source
//! its turn, and lets idle threads poll a while before they sleep. The
//! thread count does not grow with connections or peers.
//!
//! Underneath are rustix's typed system calls: an epoll set ([`Poller`]),
//! an eventfd to wake one ([`Waker`]) and a process's pidfd ([`pidfd`]);
//! no unsafe code here, and every descriptor is an `OwnedFd` closed with
//! its owner.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use rustix::event::epoll;
use rustix::time::Timespec;

/// What a registration waits for (and how: edge-triggered, one shot).
pub(crate) use rustix::event::epoll::EventFlags as Interest;

/// One ready descriptor: the token it was registered with, and what it is
/// ready for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    pub token: u64,
    pub flags: Interest,
}

impl Ready {
    /// Readable (or closed, or failed: a read says which).
    pub fn readable(&self) -> bool {
        self.flags.intersects(Interest::IN | Interest::HUP | Interest::ERR | Interest::RDHUP)
    }
}

/// What one wait found ready: a buffer a loop keeps and reuses (a wait
/// allocates nothing).
pub(crate) struct Events {
    buf: Vec<epoll::Event>,
}

impl Events {
    /// Room for `n` ready descriptors per wait.
    pub fn with_capacity(n: usize) -> Events {
        Events { buf: Vec::with_capacity(n.max(1)) }
    }

    /// What the last wait found ready.
    pub fn iter(&self) -> impl Iterator<Item = Ready> + '_ {
        self.buf.iter().map(|e| Ready { token: e.data.u64(), flags: e.flags })
    }
}

/// An epoll set.
#[derive(Debug)]
pub(crate) struct Poller {
    fd: OwnedFd,
}

impl Poller {
    /// A new set.
    pub fn new() -> io::Result<Poller> {
        Ok(Poller { fd: epoll::create(epoll::CreateFlags::CLOEXEC)? })
    }

    /// Watches `fd` for `interest`, reported with `token`.
    pub fn add(&self, fd: impl AsFd, token: u64, interest: Interest) -> io::Result<()> {
        Ok(epoll::add(&self.fd, fd, epoll::EventData::new_u64(token), interest)?)
    }

    /// Stops watching `fd`.
    pub fn delete(&self, fd: impl AsFd) -> io::Result<()> {
        Ok(epoll::delete(&self.fd, fd)?)
    }

    /// Waits until a watched descriptor is ready or `timeout` passed
    /// (`None`: no limit), and leaves what is ready in `events`. An
    /// interrupted wait returns with nothing ready.
    pub fn wait(&self, events: &mut Events, timeout: Option<Duration>) -> io::Result<()> {
        events.buf.clear();
        // rustix rounds a sub-millisecond remainder up: a deadline is never
        // woken for early.
        let ts = timeout.map(timespec);
        match epoll::wait(&self.fd, rustix::buffer::spare_capacity(&mut events.buf), ts.as_ref()) {
            Ok(_) => Ok(()),
            Err(rustix::io::Errno::INTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

fn timespec(d: Duration) -> Timespec {
    Timespec { tv_sec: d.as_secs().min(i64::MAX as u64) as i64, tv_nsec: d.subsec_nanos() as _ }
}

/// An eventfd: a counter another thread bumps to wake a poller.
#[derive(Debug)]
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub fn new() -> io::Result<Waker> {
        let flags = rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK;
        Ok(Waker { fd: rustix::event::eventfd(0, flags)? })
    }

    /// Makes it readable (never blocks: a full counter is readable already).
    pub fn wake(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Reads the counter back to 0 (nothing to read: at once).
    pub fn drain(&self) {
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut v);
    }
}

impl AsFd for Waker {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A pidfd of process `pid` (readable once it exits), or why not (an
/// older kernel, or no such process).
pub(crate) fn pidfd(pid: i32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?)
}

/// A source registered with a [`Reactor`]: the loop that owns it, and its
/// id (unique in the reactor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Token {
    lp: usize,
    pub id: u64,
}

/// What a source needs after a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Nothing until its descriptor is ready, a kick, or its deadline.
    Wait,
    /// Its turn ended with more to do (others go first).
    Again,
    /// It is done: the loop closes it.
    Close,
}

/// Something a loop drives. Only the loop that owns it calls these, one
/// at a time.
pub(crate) trait Source: Send {
    /// The descriptor the loop waits on.
    fn fd(&self) -> BorrowedFd<'_>;
    /// What it waits for (edge-triggered).
    fn interest(&self) -> Interest {
        Interest::IN | Interest::OUT | Interest::RDHUP | Interest::ET
    }
    /// The descriptor was reported ready (its turn follows).
    fn ready(&mut self, _ready: Ready) {}
    /// Does what there is to do, until it would block or its turn is used up.
    fn turn(&mut self) -> After;
    /// True while it waits for a reply: the loop then sleeps in the kernel
    /// rather than polling, since the reply wakes it.
    fn outstanding(&self) -> bool {
        false
    }
    /// True if its work comes from this process (jobs submitted by
    /// callers): after its turn the loop polls a while for the next kick
    /// rather than sleeping. A source fed by its socket alone does not
    /// (polling would take the CPU its peer's bytes need).
    fn polls(&self) -> bool {
        false
    }
    /// When [`Source::expire`] is due next (`None`: never).
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// Its deadline passed at `now`: `Again` for a turn, `Close` to end it.
    fn expire(&mut self, _now: Instant) -> After {
        After::Wait
    }
    /// It is stopped from outside (its group, the reactor, or a descriptor
    /// the loop cannot watch), for `why`; [`Source::close`] follows.
    fn stop(&mut self, _why: &str) {}
    /// It leaves its loop (after `Close` or a stop).
    fn close(&mut self) {}
}

/// Sources that stop together (a server's, an engine's initiators'): the
/// reactor keeps the set, so stopping them waits for the last one.
#[derive(Clone, Default)]
pub(crate) struct Group(Arc<GroupState>);

#[derive(Default)]
struct GroupState {
    members: Mutex<Members>,
    gone: Condvar,
}

#[derive(Default)]
struct Members {
    live: HashSet<Token>,
    stopped: bool,
}

impl Group {
    /// Stops every member (each one's `stop`, then `close`) and no new one
    /// starts; waits until they are gone, except on a loop thread (whose
    /// own loop may hold one of them).
    pub fn stop(&self, reactor: &Reactor, why: &'static str) {
        let members: Vec<Token> = {
            let mut m = self.0.members.lock();
            m.stopped = true;
            m.live.iter().copied().collect()
        };
        for t in members {
            reactor.send(t.lp, Command::Stop(t.id, why));
        }
        if on_loop() {
            return;
        }
        let mut m = self.0.members.lock();
        while !m.live.is_empty() {
            self.0.gone.wait(&mut m);
        }
    }

    fn left(&self, t: Token) {
        let mut m = self.0.members.lock();
        m.live.remove(&t);
        if m.live.is_empty() {
            self.0.gone.notify_all();
        }
    }
}

enum Command {
    Add(u64, Box<dyn Source>, Group),
    Kick(u64),
    Stop(u64, &'static str),
    StopAll,
}

/// One loop: its epoll set, its wake-up, and the commands other threads
/// send it.
struct Loop {
    index: usize,
    poller: Poller,
    wake: Waker,
    commands: Mutex<Vec<Command>>,
    /// Commands waiting (read without the lock while polling).
    waiting: AtomicUsize,
    /// Set while the thread blocks in epoll_wait (then a command writes
    /// the eventfd).
    sleeping: AtomicBool,
    spin: Duration,
}

struct Entry {
    src: Box<dyn Source>,
    group: Group,
}

/// epoll data of a loop's wake-up eventfd (sources count from 1).
const WAKE: u64 = 0;

/// How long a polling loop looks at its commands between two looks at its
/// descriptors.
const SPIN_SLICE: Duration = Duration::from_micros(4);

thread_local! {
    /// Set on loop threads.
    static ON_LOOP: Cell<bool> = const { Cell::new(false) };
}

/// True on a reactor's thread.
pub(crate) fn on_loop() -> bool {
    ON_LOOP.with(Cell::get)
}

/// The engine's event loop: a fixed set of threads (one per core, at most
/// 4), each owning the sources it was given.
pub(crate) struct Reactor {
    loops: Vec<Arc<Loop>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_loop: AtomicUsize,
    next_id: AtomicU64,
}

impl Reactor {
    /// Starts the threads (named `orbite-{name}-N`); an idle one polls for
    /// `spin` after work before it sleeps.
    pub fn start(name: &str, spin: Duration) -> io::Result<Arc<Reactor>> {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
        let mut loops = Vec::new();
        for index in 0..n {
            let poller = Poller::new()?;
            let wake = Waker::new()?;
            poller.add(&wake, WAKE, Interest::IN | Interest::ET)?;
            let commands = Mutex::new(Vec::new());
            let (waiting, sleeping) = (AtomicUsize::new(0), AtomicBool::new(false));
            loops.push(Arc::new(Loop { index, poller, wake, commands, waiting, sleeping, spin }));
        }
        let me = Arc::new(Reactor {
            loops,
            threads: Mutex::new(Vec::new()),
            next_loop: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        });
        for (i, l) in me.loops.iter().enumerate() {
            let l = l.clone();
            let run = move || {
                l.run();
                // The streams its turns made (target staging) go with it,
                // in plain code: in a thread-local destructor the driver's
                // per-thread state may be gone already, and they would leak.
                crate::cuda::release_thread_streams();
            };
            match std::thread::Builder::new().name(format!("orbite-{name}-{i}")).spawn(run) {
                Ok(h) => me.threads.lock().push(h),
                Err(e) => {
                    me.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(me)
    }

    /// Gives the source `make` builds (told its token) to the next loop, in
    /// `group`. A group that was stopped takes none: the source is stopped
    /// at once.
    pub fn add(&self, group: &Group, make: impl FnOnce(Token) -> Box<dyn Source>) -> Token {
        let lp = self.next_loop.fetch_add(1, Ordering::Relaxed) % self.loops.len();
        let t = Token { lp, id: self.next_id.fetch_add(1, Ordering::Relaxed) };
        let mut src = make(t);
        {
            let mut m = group.0.members.lock();
            if !m.stopped {
                // Sent under the lock: a stop that sees the member comes
                // after it in its loop's commands.
                m.live.insert(t);
                self.send(lp, Command::Add(t.id, src, group.clone()));
                return t;
            }
        }
        src.stop("the engine closed");
        src.close();
        t
    }

    /// Gives the source a turn soon.
    pub fn kick(&self, t: Token) {
        self.send(t.lp, Command::Kick(t.id));
    }

    /// Stops one source (its `stop`, then `close`).
    pub fn remove(&self, t: Token, why: &'static str) {
        self.send(t.lp, Command::Stop(t.id, why));
    }

    fn send(&self, lp: usize, c: Command) {
        let l = &self.loops[lp];
        l.commands.lock().push(c);
        l.waiting.fetch_add(1, Ordering::SeqCst);
        if l.sleeping.load(Ordering::SeqCst) {
            l.wake.wake();
        }
    }

    /// Stops every source and the threads, and joins them (unless called on
    /// one of them).
    pub fn shutdown(&self) {
        for l in 0..self.loops.len() {
            self.send(l, Command::StopAll);
        }
        if on_loop() {
            return;
        }
        for t in std::mem::take(&mut *self.threads.lock()) {
            let _ = t.join();
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        for l in 0..self.loops.len() {
            self.send(l, Command::StopAll);
            self.loops[l].wake.wake();
        }
    }
}

impl Loop {
    fn run(&self) {
        ON_LOOP.with(|d| d.set(true));
        let mut sources: HashMap<u64, Entry> = HashMap::new();
        let mut ready: Vec<u64> = Vec::new();
        let mut events = Events::with_capacity(64);
        let mut next_deadline: Option<Instant> = None;
        let mut spin_until: Option<Instant> = None;
        // Sources waiting for a reply: while there are any, the thread
        // blocks in epoll_wait for them (the kernel wakes it); only a loop
        // with none polls for new work.
        let mut outstanding = 0usize;
        loop {
            // Whether this round's work came from this process (a kick, or
            // a source that polls): then the loop polls after it.
            let mut local_work = false;
            // Commands first: new sources, kicks, stops.
            if self.waiting.load(Ordering::SeqCst) > 0 {
                local_work = true;
                let cmds = std::mem::take(&mut *self.commands.lock());
                self.waiting.fetch_sub(cmds.len(), Ordering::SeqCst);
                for c in cmds {
                    match c {
                        Command::Add(id, src, group) => {
                            let e = Entry { src, group };
                            if self.poller.add(e.src.fd(), id, e.src.interest()).is_err() {
                                self.retire(id, e, Some("connection lost: cannot watch the socket"));
                                continue;
                            }
                            sources.insert(id, e);
                            ready.push(id);
                        }
                        Command::Kick(id) => ready.push(id),
                        Command::Stop(id, why) => {
                            if let Some(e) = sources.remove(&id) {
                                outstanding -= e.src.outstanding() as usize;
                                self.retire(id, e, Some(why));
                            }
                        }
                        Command::StopAll => {
                            for (id, e) in sources.drain() {
                                self.retire(id, e, Some("connection lost: the engine closed"));
                            }
                            return;
                        }
                    }
                }
            }
            let mut again = Vec::new();
            ready.sort_unstable();
            ready.dedup();
            for id in ready.drain(..) {
                let Some(e) = sources.get_mut(&id) else { continue };
                let before = e.src.outstanding();
                local_work |= e.src.polls();
                let after = e.src.turn();
                outstanding -= before as usize;
                match after {
                    After::Wait => {}
                    After::Again => again.push(id),
                    After::Close => {
                        if let Some(e) = sources.remove(&id) {
                            self.retire(id, e, None);
                        }
                        continue;
                    }
                }
                outstanding += e.src.outstanding() as usize;
                if let Some(d) = e.src.deadline() {
                    next_deadline = Some(next_deadline.map_or(d, |n| n.min(d)));
                }
            }
            ready = again;
            let mut now = Instant::now();
            if next_deadline.is_some_and(|d| now >= d) {
                next_deadline = None;
                let mut closed = Vec::new();
                for (id, e) in sources.iter_mut() {
                    match e.src.expire(now) {
                        After::Wait => {}
                        After::Again => ready.push(*id),
                        After::Close => closed.push(*id),
                    }
                    if let Some(d) = e.src.deadline() {
                        next_deadline = Some(next_deadline.map_or(d, |n| n.min(d)));
                    }
                }
                for id in closed {
                    if let Some(e) = sources.remove(&id) {
                        self.retire(id, e, None);
                    }
                }
                outstanding = sources.values().filter(|e| e.src.outstanding()).count();
                now = Instant::now();
            }
            // Idle after work callers gave it: poll a while (commands, and
            // now and then the descriptors) before sleeping.
            if local_work && ready.is_empty() && outstanding == 0 && !self.spin.is_zero() {
                spin_until = now.checked_add(self.spin);
            }
            let timeout = if !ready.is_empty() {
                Some(Duration::ZERO)
            } else if spin_until.is_some_and(|until| now < until) {
                if crate::transport::spin::poll(&self.waiting, SPIN_SLICE) {
                    continue;
                }
                Some(Duration::ZERO)
            } else {
                spin_until = None;
                self.sleeping.store(true, Ordering::SeqCst);
                if self.waiting.load(Ordering::SeqCst) > 0 {
                    self.sleeping.store(false, Ordering::SeqCst);
                    continue;
                }
                // Rounded up to the next millisecond: never woken early.
                next_deadline.map(|d| d.saturating_duration_since(now))
            };
            let waited = self.poller.wait(&mut events, timeout);
            self.sleeping.store(false, Ordering::SeqCst);
            if waited.is_err() {
                continue;
            }
            for ev in events.iter() {
                match ev.token {
                    WAKE => self.wake.drain(),
                    id => {
                        if let Some(e) = sources.get_mut(&id) {
                            e.src.ready(ev);
                            ready.push(id);
                        }
                    }
                }
            }
        }
    }

    /// Takes source `id` out of the loop: stopped first if `why`.
    fn retire(&self, id: u64, mut e: Entry, why: Option<&str>) {
        let _ = self.poller.delete(e.src.fd());
        if let Some(why) = why {
            e.src.stop(why);
        }
        e.src.close();
        e.group.left(Token { lp: self.index, id });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waker_wakes_a_poller_and_drains_back_to_quiet() {
        let p = Poller::new().unwrap();
        let w = Waker::new().unwrap();
        p.add(&w, 7, Interest::IN).unwrap();
        let mut ready = Events::with_capacity(8);
        p.wait(&mut ready, Some(Duration::ZERO)).unwrap();
        assert_eq!(ready.iter().count(), 0, "nothing before a wake");
        w.wake();
        w.wake();
        p.wait(&mut ready, Some(Duration::from_secs(5))).unwrap();
        let got: Vec<Ready> = ready.iter().collect();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].token, 7);
        assert!(got[0].readable());
        w.drain();
        p.wait(&mut ready, Some(Duration::ZERO)).unwrap();
        assert_eq!(ready.iter().count(), 0, "drained (level-triggered: still readable otherwise)");
    }

    #[test]
    fn a_pidfd_becomes_readable_when_its_process_exits() {
        let mut child = std::process::Command::new("sleep").arg("0.05").spawn().unwrap();
        let fd = match pidfd(child.id() as i32) {
            Ok(fd) => fd,
            Err(e) => {
                println!("SKIP: pidfd_open is not available here ({e})");
                child.wait().unwrap();
                return;
            }
        };
        let p = Poller::new().unwrap();
        p.add(&fd, 3, Interest::IN | Interest::ONESHOT).unwrap();
        let mut ready = Events::with_capacity(8);
        while ready.iter().next().is_none() {
            p.wait(&mut ready, Some(Duration::from_secs(5))).unwrap();
        }
        assert_eq!(ready.iter().next().map(|r| r.token), Some(3));
        child.wait().unwrap();
        p.delete(&fd).unwrap();
        assert!(pidfd(0).is_err(), "no pid 0");
    }

    /// A source that reports what happened to it.
    struct Probe {
        fd: Waker,
        log: std::sync::mpsc::Sender<String>,
        due: Option<Instant>,
        turns: usize,
    }

    impl Source for Probe {
        fn fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }

        fn interest(&self) -> Interest {
            Interest::IN | Interest::ET
        }

        fn turn(&mut self) -> After {
            self.fd.drain();
            self.turns += 1;
            let _ = self.log.send(format!("turn {}", self.turns));
            After::Wait
        }

        fn deadline(&self) -> Option<Instant> {
            self.due
        }

        fn expire(&mut self, now: Instant) -> After {
            if self.due.is_some_and(|d| now >= d) {
                let _ = self.log.send("expired".into());
                return After::Close;
            }
            After::Wait
        }

        fn stop(&mut self, why: &str) {
            let _ = self.log.send(format!("stopped: {why}"));
        }

        fn close(&mut self) {
            let _ = self.log.send("closed".into());
        }
    }

    fn probe(log: &std::sync::mpsc::Sender<String>, due: Option<Duration>) -> Box<dyn Source> {
        let due = due.map(|d| Instant::now() + d);
        Box::new(Probe { fd: Waker::new().unwrap(), log: log.clone(), due, turns: 0 })
    }

    fn next(rx: &std::sync::mpsc::Receiver<String>) -> String {
        rx.recv_timeout(Duration::from_secs(10)).expect("the reactor reports")
    }

    #[test]
    fn sources_get_turns_and_deadlines_and_a_stopped_group_waits_for_its_members() {
        let r = Reactor::start("test", Duration::from_micros(20)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let g = Group::default();
        let t = r.add(&g, |_| probe(&tx, None));
        assert_eq!(next(&rx), "turn 1", "a new source gets a turn");
        r.kick(t);
        assert_eq!(next(&rx), "turn 2", "and one per kick");
        let start = Instant::now();
        let other = Group::default();
        r.add(&other, |_| probe(&tx, Some(Duration::from_millis(30))));
        assert_eq!(next(&rx), "turn 1");
        assert_eq!(next(&rx), "expired");
        assert_eq!(next(&rx), "closed", "Close after its deadline");
        assert!(start.elapsed() >= Duration::from_millis(30), "not before its deadline");
        g.stop(&r, "the test stops it");
        let said: Vec<String> = rx.try_iter().collect();
        assert_eq!(said, ["stopped: the test stops it", "closed"], "stop returns once its member is gone");
        r.add(&g, |_| probe(&tx, None));
        let said: Vec<String> = rx.try_iter().collect();
        assert_eq!(said, ["stopped: the engine closed", "closed"], "a stopped group takes no new source");
        r.add(&other, |_| probe(&tx, None));
        assert_eq!(next(&rx), "turn 1");
        r.shutdown();
        let said: Vec<String> = rx.try_iter().collect();
        assert_eq!(said, ["stopped: connection lost: the engine closed", "closed"], "shutdown stops the rest");
    }
}
