//! Blocking socket I/O straight to and from registered memory.
//!
//! `std`'s `Read`/`Write` take `&mut [u8]`/`&[u8]`, which would assert
//! exclusive or shared Rust borrows over memory that peers and the caller
//! may touch concurrently. These helpers pass raw pointers to
//! `readv`/`writev` instead, loop over partial transfers and `EINTR`, and
//! report how many bytes moved before an error (the exact prefix).

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Largest iovec count per system call (Linux `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// An I/O vector entry over raw memory.
pub(crate) fn iov(ptr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: len as usize }
}

/// One `readv` or `writev`.
type VectoredCall = unsafe extern "C" fn(libc::c_int, *const libc::iovec, libc::c_int) -> libc::ssize_t;

/// Bounds on how long an I/O may take, for sockets whose system calls
/// time out (`SO_RCVTIMEO`/`SO_SNDTIMEO` set to a short tick): a call that
/// times out is retried until no byte has moved for `stall`, or until
/// `until` passes; then the I/O fails with `TimedOut`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Patience {
    /// Longest time without a byte moving.
    pub stall: std::time::Duration,
    /// When the whole I/O must be done, if ever.
    pub until: Option<std::time::Instant>,
}

impl Patience {
    /// Checks the bounds after a call moved nothing (`last`: when a byte
    /// last moved).
    fn check(&self, last: std::time::Instant) -> io::Result<()> {
        let now = std::time::Instant::now();
        if now.duration_since(last) >= self.stall {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no sign of life for {} ms", self.stall.as_millis()),
            ));
        }
        self.check_rate(now)
    }

    fn check_rate(&self, now: std::time::Instant) -> io::Result<()> {
        if self.until.is_some_and(|u| now >= u) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "slower than the minimum peer rate"));
        }
        Ok(())
    }
}

/// Runs `call` until every byte of `iovs` moved (advancing them in place),
/// retrying on `EINTR`; calls that time out are retried within
/// `patience`'s bounds.
///
/// # Safety
/// Every entry must address memory valid for `call` (readable for writes,
/// writable and unaliased for reads) for the whole call.
unsafe fn vectored(fd: RawFd, iovs: &mut [libc::iovec], call: VectoredCall, patience: &Patience) -> io::Result<()> {
    let mut first = 0;
    let mut last = std::time::Instant::now();
    while first < iovs.len() {
        if iovs[first].iov_len == 0 {
            first += 1;
            continue;
        }
        let n = (iovs.len() - first).min(IOV_MAX);
        // SAFETY: the entries are valid per the function contract; the
        // array slice is in bounds.
        let r = unsafe { call(fd, iovs[first..].as_ptr(), n as libc::c_int) };
        if r < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => patience.check(last)?,
                _ => return Err(e),
            }
            continue;
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
        }
        advance(iovs, &mut first, r as usize);
        // A trickling peer moves bytes but never finishes in time.
        last = std::time::Instant::now();
        if first < iovs.len() {
            patience.check_rate(last)?;
        }
    }
    Ok(())
}

/// Writes every byte of `iovs` (advancing them in place) within
/// `patience` (a socket with a timeout tick).
///
/// # Safety
/// Every entry must address memory readable for its length for the whole
/// call (kept alive by range loans).
pub(crate) unsafe fn writev_within(fd: RawFd, iovs: &mut [libc::iovec], patience: &Patience) -> io::Result<()> {
    // SAFETY: forwarded contract.
    unsafe { vectored(fd, iovs, libc::writev, patience) }
}

/// Advances `iovs` (from `first`) past `n` bytes that were transferred.
pub(crate) fn advance(iovs: &mut [libc::iovec], first: &mut usize, mut n: usize) {
    while n > 0 && *first < iovs.len() {
        let v = &mut iovs[*first];
        if n >= v.iov_len {
            n -= v.iov_len;
            v.iov_len = 0;
            *first += 1;
        } else {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
    // Empty entries carry nothing: never wait for them.
    while *first < iovs.len() && iovs[*first].iov_len == 0 {
        *first += 1;
    }
}

/// Reads exactly `buf.len()` bytes into an ordinary buffer, within
/// `patience` (a socket with a timeout tick).
pub(crate) fn read_exact_within(fd: RawFd, buf: &mut [u8], patience: &Patience) -> io::Result<()> {
    let mut v = [iov(buf.as_mut_ptr() as u64, buf.len() as u64)];
    // SAFETY: `buf` is an exclusive borrow valid for the call.
    unsafe { vectored(fd, &mut v, libc::readv, patience) }
}

/// Sets `TCP_NODELAY` and the socket buffers of a data connection: a
/// receive buffer of `window` bytes (the kernel doubles it for its
/// bookkeeping, so the window it advertises is about `window`) and a send
/// buffer of twice that (a connection's two requests in flight). The kernel
/// caps both at `net.core.rmem_max` / `wmem_max`.
///
/// Why a window of one route task, not as much as the kernel allows: a
/// sender then has one task on the wire per connection while the receiver
/// drains it, and the next is put on the wire by the receiver's own
/// acknowledgements (the kernel sends queued segments from the context
/// that processes the ACK), so the TCP work of a transfer is shared by
/// both ends instead of piling on the sender, and the bytes a receiver
/// copies out are ones written moments before. On the 2-core machine of
/// docs/bench.md this moved W1 and W3 10-25 % faster than 4 MiB buffers,
/// READ most, and brought READ level with WRITE.
pub(crate) fn tune(stream: &TcpStream, window: u64) {
    let _ = stream.set_nodelay(true);
    let rcv = window.clamp(4096, i32::MAX as u64 / 2) as libc::c_int;
    set_opt(stream.as_raw_fd(), libc::SO_RCVBUF, rcv);
    set_opt(stream.as_raw_fd(), libc::SO_SNDBUF, 2 * rcv);
}

/// Sets a socket's send buffer (`SO_SNDBUF`; the kernel doubles it for its
/// bookkeeping).
pub(crate) fn set_send_buffer(socket: &impl AsRawFd, bytes: usize) {
    set_opt(socket.as_raw_fd(), libc::SO_SNDBUF, bytes.min(i32::MAX as usize / 2) as libc::c_int);
}

/// Sets the `SOL_SOCKET` option `opt` of `fd` to `value` (best effort).
fn set_opt(fd: RawFd, opt: libc::c_int, value: libc::c_int) {
    // SAFETY: setsockopt with a pointer to a live c_int of the right size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// A connected stream socket, TCP or Unix-domain: what the drivers read
/// and write (raw `readv`/`writev` on its descriptor).
pub(crate) struct Stream(OwnedFd);

impl Stream {
    /// Shuts both directions down (the peer sees the end at once, even
    /// while another thread still holds the descriptor).
    pub fn shutdown(&self) {
        // SAFETY: shutdown on a descriptor this value owns.
        unsafe { libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR) };
    }

    /// Makes the socket non-blocking.
    pub fn set_nonblocking(&self) -> io::Result<()> {
        let fd = self.0.as_raw_fd();
        // SAFETY: fcntl on a descriptor this value owns.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl std::os::fd::AsFd for Stream {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream(s.into())
    }
}

impl From<std::os::unix::net::UnixStream> for Stream {
    fn from(s: std::os::unix::net::UnixStream) -> Self {
        Stream(s.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(stream: &TcpStream, opt: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a live c_int of the right size.
        let r = unsafe {
            libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, opt, (&mut v as *mut libc::c_int).cast(), &mut len)
        };
        assert_eq!(r, 0);
        v
    }

    fn sysctl(name: &str) -> libc::c_int {
        std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The kernel doubles what it is asked (for its bookkeeping) after
    /// capping it at the system's maximum.
    #[test]
    fn a_data_connection_gets_the_window_as_receive_buffer_and_twice_it_to_send() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rmax, wmax) = (sysctl("rmem_max"), sysctl("wmem_max"));
        for window in [64 << 10, 1 << 20, 3 << 20] {
            tune(&stream, window);
            let expect = |asked: libc::c_int, max: libc::c_int| 2 * if max > 0 { asked.min(max) } else { asked };
            assert_eq!(option(&stream, libc::SO_RCVBUF), expect(window as libc::c_int, rmax), "{window}");
            assert_eq!(option(&stream, libc::SO_SNDBUF), expect(2 * window as libc::c_int, wmax), "{window}");
        }
        assert!(stream.nodelay().unwrap());
    }
}
