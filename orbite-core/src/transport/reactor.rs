//! What the engine's event loops wait with: an epoll set ([`Poller`]), an
//! eventfd to wake one ([`Waker`]), a monotonic timerfd ([`Timer`]) and a
//! process's pidfd ([`pidfd`]). The tcp server, the initiators' drivers
//! and the peer-liveness watcher all wait through these, over rustix's
//! typed system calls: no unsafe code here, and every descriptor is an
//! `OwnedFd` closed with its owner.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;
use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec};

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

    /// Changes what `fd` is watched for (and re-arms a one-shot watch).
    pub fn modify(&self, fd: impl AsFd, token: u64, interest: Interest) -> io::Result<()> {
        Ok(epoll::modify(&self.fd, fd, epoll::EventData::new_u64(token), interest)?)
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

/// A monotonic timerfd: readable once it expires.
#[derive(Debug)]
pub(crate) struct Timer {
    fd: OwnedFd,
}

impl Timer {
    pub fn new() -> io::Result<Timer> {
        let flags = TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK;
        Ok(Timer { fd: rustix::time::timerfd_create(TimerfdClockId::Monotonic, flags)? })
    }

    /// Expires every `every` from now on; `None` disarms it.
    pub fn set_periodic(&self, every: Option<Duration>) {
        let t = every.map_or(timespec(Duration::ZERO), |d| timespec(d.max(Duration::from_nanos(1))));
        let spec = Itimerspec { it_interval: t, it_value: t };
        let _ = rustix::time::timerfd_settime(&self.fd, TimerfdTimerFlags::empty(), &spec);
    }

    /// Reads its expiry count (nothing expired: at once).
    pub fn drain(&self) {
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut v);
    }
}

impl AsFd for Timer {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

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
    fn a_timer_fires_after_its_period_and_can_be_disarmed() {
        let p = Poller::new().unwrap();
        let t = Timer::new().unwrap();
        p.add(&t, 1, Interest::IN).unwrap();
        let start = Instant::now();
        t.set_periodic(Some(Duration::from_millis(30)));
        let mut ready = Events::with_capacity(8);
        while ready.iter().next().is_none() {
            p.wait(&mut ready, Some(Duration::from_secs(5))).unwrap();
        }
        assert!(start.elapsed() >= Duration::from_millis(30), "not before its delay");
        t.set_periodic(None);
        t.drain();
        p.wait(&mut ready, Some(Duration::from_millis(60))).unwrap();
        assert_eq!(ready.iter().count(), 0, "disarmed");
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
}
