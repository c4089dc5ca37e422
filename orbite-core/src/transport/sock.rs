//! Blocking socket I/O straight to and from registered memory.
//!
//! `std`'s `Read`/`Write` take `&mut [u8]`/`&[u8]`, which would assert
//! exclusive or shared Rust borrows over memory that peers and the caller
//! may touch concurrently. These helpers pass raw pointers to
//! `readv`/`writev` instead, loop over partial transfers and `EINTR`, and
//! report how many bytes moved before an error (the exact prefix).

use std::io;
use std::os::fd::RawFd;

/// Largest iovec count per system call (Linux `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// An I/O vector entry over raw memory.
pub(crate) fn iov(ptr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: len as usize }
}

/// One `readv` or `writev`.
type VectoredCall = unsafe extern "C" fn(libc::c_int, *const libc::iovec, libc::c_int) -> libc::ssize_t;

/// Runs `call` until every byte of `iovs` moved (advancing them in place),
/// retrying on `EINTR`; `done` counts the bytes moved, also on error.
///
/// # Safety
/// Every entry must address memory valid for `call` (readable for writes,
/// writable and unaliased for reads) for the whole call.
unsafe fn vectored(fd: RawFd, iovs: &mut [libc::iovec], done: &mut u64, call: VectoredCall) -> io::Result<()> {
    let mut first = 0;
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
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
        }
        *done += r as u64;
        advance(iovs, &mut first, r as usize);
    }
    Ok(())
}

/// Writes every byte of `iovs` (advancing them in place).
///
/// # Safety
/// Every entry must address memory readable for its length for the whole
/// call (kept alive by range loans).
pub(crate) unsafe fn writev_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut done = 0;
    // SAFETY: forwarded contract.
    unsafe { vectored(fd, iovs, &mut done, libc::writev) }
}

/// Fills every byte of `iovs` from the socket; `done` counts the bytes that
/// landed, also when an error or EOF stops it early.
///
/// # Safety
/// Every entry must address memory writable for its length for the whole
/// call, which no Rust reference aliases.
pub(crate) unsafe fn readv_all(fd: RawFd, iovs: &mut [libc::iovec], done: &mut u64) -> io::Result<()> {
    // SAFETY: forwarded contract.
    unsafe { vectored(fd, iovs, done, libc::readv) }
}

fn advance(iovs: &mut [libc::iovec], first: &mut usize, mut n: usize) {
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
}

/// Reads exactly `buf.len()` bytes into an ordinary buffer.
pub(crate) fn read_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut v = [iov(buf.as_mut_ptr() as u64, buf.len() as u64)];
    let mut done = 0;
    // SAFETY: `buf` is an exclusive borrow valid for the call.
    unsafe { readv_all(fd, &mut v, &mut done) }
}

/// Reads and discards `n` bytes (keeps a stream in sync after a refusal).
pub(crate) fn discard(fd: RawFd, mut n: u64, scratch: &mut [u8]) -> io::Result<()> {
    while n > 0 {
        let k = (n as usize).min(scratch.len());
        read_exact(fd, &mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}
