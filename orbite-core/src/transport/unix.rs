//! The local socket: an abstract Unix-domain socket every listening engine
//! also serves its protocol on, so that a peer on the same host can prove
//! who it talks to.
//!
//! Nothing a peer says about this host is believed: its pid, boot id and
//! shared-file names arrive over the network. A connection to its local
//! socket is different: the kernel reports the listening process's pid as
//! seen from this pid namespace and its uid (`SO_PEERCRED`), and an
//! abstract socket is reachable only from the same network namespace. A
//! peer is same-host when that connection reaches a process of this user
//! that answers with the epoch the network named; same-host routes then
//! use only what came over it (its pid, its registrations).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};

/// The local socket name of the engine with `epoch` (abstract: no file).
pub(crate) fn socket_name(epoch: u64) -> String {
    format!("orbite-{epoch:016x}")
}

/// True for a name [`socket_name`] makes (a peer's claim is checked
/// before it is connected to).
pub(crate) fn is_socket_name(name: &str) -> bool {
    name.strip_prefix("orbite-").is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Binds the abstract socket `name` (in this network namespace).
pub(crate) fn bind(name: &str) -> io::Result<UnixListener> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let l = UnixListener::bind_addr(&addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// What the kernel says of the process at the other end of a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credentials {
    /// Its pid in this pid namespace (0: it is not visible here).
    pub pid: i32,
    pub uid: u32,
}

/// The credentials of `fd`'s peer (for a connected socket, the listener's
/// at the time it listened; for an accepted one, the connecter's).
pub(crate) fn peer_credentials(fd: RawFd) -> io::Result<Credentials> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into a live ucred.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut c as *mut libc::ucred).cast(), &mut len)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Credentials { pid: c.pid, uid: c.uid })
}

/// This process's effective uid.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Why a local socket did not lead to a process of this user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LocalConnectError {
    #[error("{0:?} is not a local socket name")]
    NotSocketName(String),
    #[error("socket: {0}")]
    Socket(String),
    #[error("nothing listens on the local socket {0} here (another network namespace)")]
    NothingListens(String),
    #[error("the local socket {0} is busy")]
    Busy(String),
    #[error("cannot connect to the local socket {name}: {err}")]
    Connect { name: String, err: String },
    #[error("SO_PEERCRED: {0}")]
    Credentials(String),
    #[error("the local socket {name} belongs to uid {uid}, not this user ({me})")]
    OtherUser { name: String, uid: u32, me: u32 },
    #[error("the process behind the local socket {0} is not visible in this pid namespace")]
    PidHidden(String),
    #[error("{0}")]
    Setup(String),
}

/// Connects to the abstract socket `name` without waiting for a full
/// backlog, then checks that a process of this user listens there: the
/// blocking stream (its calls time out every `tick`) and its listener's
/// credentials.
pub(crate) fn connect(name: &str, tick: std::time::Duration) -> Result<(UnixStream, Credentials), LocalConnectError> {
    if !is_socket_name(name) {
        return Err(LocalConnectError::NotSocketName(name.to_owned()));
    }
    // SAFETY: plain system call creating a descriptor.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(LocalConnectError::Socket(io::Error::last_os_error().to_string()));
    }
    // SAFETY: a fresh descriptor this function now owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    // sun_path[0] stays 0: the abstract namespace.
    for (d, s) in sa.sun_path[1..].iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len()) as libc::socklen_t;
    // SAFETY: connect with a pointer to a live sockaddr_un of `len` bytes.
    let r = unsafe { libc::connect(fd.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => LocalConnectError::NothingListens(name.to_owned()),
            Some(libc::EAGAIN) => LocalConnectError::Busy(name.to_owned()),
            _ => LocalConnectError::Connect { name: name.to_owned(), err: e.to_string() },
        });
    }
    let s = UnixStream::from(fd);
    let cred = peer_credentials(s.as_raw_fd()).map_err(|e| LocalConnectError::Credentials(e.to_string()))?;
    let me = my_uid();
    if cred.uid != me {
        return Err(LocalConnectError::OtherUser { name: name.to_owned(), uid: cred.uid, me });
    }
    if cred.pid <= 0 {
        return Err(LocalConnectError::PidHidden(name.to_owned()));
    }
    let setup = || -> io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(tick))?;
        s.set_write_timeout(Some(tick))
    };
    setup().map_err(|e| LocalConnectError::Setup(e.to_string()))?;
    Ok((s, cred))
}

/// Room for the control message of `n` descriptors.
fn cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is arithmetic.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<i32>()) as u32) as usize }
}

/// One `sendmsg` of `iovs` with `fds` attached (`SCM_RIGHTS`): what
/// `writev` would return.
///
/// # Safety
/// Every entry must address memory readable for its length; `fds` must be
/// open descriptors.
pub(crate) unsafe fn send_with_fds(fd: RawFd, iovs: &[libc::iovec], fds: &[RawFd]) -> isize {
    let mut control = vec![0u8; cmsg_space(fds.len())];
    // SAFETY: msghdr is plain data; zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iovs.len().min(1024);
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: the control buffer has room for one header and `fds`
    // (CMSG_SPACE); the macros stay inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<i32>(), fds.len());
        libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
    }
}

/// One `recvmsg` into `buf`, keeping at most `max_fds` descriptors that
/// arrive with it (close-on-exec) in `fds`: the bytes read. More
/// descriptors than that (a truncated control message) is an error; those
/// the kernel delivered are closed.
pub(crate) fn recv_with_fds(fd: RawFd, buf: &mut [u8], max_fds: usize, fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut control = vec![0u8; cmsg_space(max_fds.max(1))];
    let mut v = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut v;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: the iovec and control buffer are live for the call.
    let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut got = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, within
    // `msg_controllen`, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<i32>();
                let n = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<i32>();
                for i in 0..n {
                    got.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() + got.len() > max_fds {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more descriptors than asked for"));
    }
    fds.extend(got);
    Ok(r as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_reached_with_its_credentials_and_names_are_checked() {
        let name = socket_name(0x5eed_0000_0000_0000 ^ u64::from(std::process::id()));
        assert!(is_socket_name(&name));
        for bad in
            ["", "orbite-", "orbite-123", "orbite-0123456789abcdeg", "x-0123456789abcdef", "orbite-0123456789abcdef0"]
        {
            assert!(!is_socket_name(bad), "{bad:?}");
        }
        let l = bind(&name).unwrap();
        let (s, cred) = connect(&name, std::time::Duration::from_millis(10)).unwrap();
        assert_eq!(cred, Credentials { pid: std::process::id() as i32, uid: my_uid() });
        let (accepted, _) = l.accept().unwrap();
        assert_eq!(peer_credentials(accepted.as_raw_fd()).unwrap().pid, std::process::id() as i32);
        drop((s, accepted, l));
        assert_eq!(
            connect(&name, std::time::Duration::from_millis(10)).unwrap_err(),
            LocalConnectError::NothingListens(name.clone())
        );
        assert!(connect("/etc/passwd", std::time::Duration::from_millis(10)).is_err());
    }

    #[test]
    fn descriptors_travel_with_the_first_byte() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let data = *b"hello";
        let v = [libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() }];
        // SAFETY: the iovec covers a live local; the descriptor is open.
        assert_eq!(unsafe { send_with_fds(a.as_raw_fd(), &v, &[f.as_raw_fd(), f.as_raw_fd()]) }, 5);
        let mut buf = [0u8; 2];
        let mut fds = Vec::new();
        assert!(recv_with_fds(b.as_raw_fd(), &mut buf, 1, &mut fds).is_err(), "two descriptors, one asked for");
        assert!(fds.is_empty());
        // SAFETY: as above.
        assert_eq!(unsafe { send_with_fds(a.as_raw_fd(), &v, &[f.as_raw_fd()]) }, 5);
        let mut rest = [0u8; 3];
        let mut fds = Vec::new();
        recv_with_fds(b.as_raw_fd(), &mut rest, 0, &mut fds).unwrap(); // the first message's tail
        let mut buf = [0u8; 5];
        assert_eq!(recv_with_fds(b.as_raw_fd(), &mut buf, 1, &mut fds).unwrap(), 5);
        assert_eq!(fds.len(), 1);
    }
}
