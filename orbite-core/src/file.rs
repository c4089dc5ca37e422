//! Local files: [`Entry`] (an open file the engine owns) and [`FileIo`]
//! (reads and writes between registered memory and a file, with io_uring).
//!
//! This is the storage building block of the local file route: an Entry is
//! opened from a validated path with an explicit mode, or adopted from a
//! caller's descriptor by a checked `dup` (never by resolving a path or
//! /proc/self/fd again, which could reach another inode). Offsets and
//! lengths are checked before any I/O. Closing an Entry fences new I/O at
//! once and waits for admitted I/O to drain; a descriptor number the
//! process reuses later never reaches the closed Entry, because the Entry
//! owns its own duplicate.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// How a file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileMode {
    /// Reads only: a WRITE into it is refused before any I/O.
    ReadOnly,
    /// Reads and writes.
    ReadWrite,
}

/// Flags that change durability or caching. Each one is either implemented
/// or refused with [`FileError::Unsupported`]; none is silently dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct OpenFlags {
    /// Bypass the page cache (`O_DIRECT`). Not implemented yet: refused.
    pub direct: bool,
    /// Every write durable on return (`O_SYNC`). Not implemented yet:
    /// refused.
    pub sync: bool,
}

/// Why a file operation was refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    /// The path is empty, relative, or has a NUL byte.
    #[error("invalid path: {0}")]
    InvalidPath(String),
    /// A flag or mode that is not implemented.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// Not a regular file.
    #[error("not a regular file")]
    NotRegular,
    /// The descriptor's access mode does not allow the requested mode.
    #[error("the descriptor is not open for {0}")]
    ModeMismatch(&'static str),
    /// The Entry was closed: no new I/O.
    #[error("the file entry is closed")]
    Closed,
    /// Offsets or lengths out of range (or overflowing).
    #[error("out of range: {0}")]
    OutOfRange(String),
    /// Closing waited too long for admitted I/O (the Entry stays fenced).
    #[error("admitted I/O did not drain within the bound")]
    DrainTimeout,
    /// An operating-system error.
    #[error("{what}: {err}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The error.
        err: String,
    },
}

fn os(what: &'static str) -> FileError {
    FileError::Os { what, err: std::io::Error::last_os_error().to_string() }
}

#[derive(Default)]
struct Admission {
    closed: bool,
    active: u64,
}

/// An open regular file owned by the engine.
pub struct Entry {
    fd: OwnedFd,
    mode: FileMode,
    dev: u64,
    ino: u64,
    state: Mutex<Admission>,
    drained: Condvar,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry").field("mode", &self.mode).field("dev", &self.dev).field("ino", &self.ino).finish()
    }
}

/// One admitted I/O: counts against the Entry until dropped.
struct Admitted<'a>(&'a Entry);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.active -= 1;
        if s.active == 0 {
            self.0.drained.notify_all();
        }
    }
}

impl Entry {
    /// Opens `path` (absolute) in `mode`. Flags that are not implemented
    /// are refused before anything is opened.
    pub fn open(path: &Path, mode: FileMode, flags: OpenFlags) -> Result<Entry, FileError> {
        if flags.direct {
            return Err(FileError::Unsupported("O_DIRECT"));
        }
        if flags.sync {
            return Err(FileError::Unsupported("O_SYNC"));
        }
        use std::os::unix::ffi::OsStrExt;
        let bytes = path.as_os_str().as_bytes();
        if bytes.is_empty() || !path.is_absolute() || bytes.contains(&0) {
            return Err(FileError::InvalidPath(path.display().to_string()));
        }
        let c = std::ffi::CString::new(bytes).map_err(|_| FileError::InvalidPath(path.display().to_string()))?;
        let access = match mode {
            FileMode::ReadOnly => libc::O_RDONLY,
            FileMode::ReadWrite => libc::O_RDWR,
        };
        // SAFETY: a NUL-terminated path; the returned descriptor is owned.
        let fd = unsafe { libc::open(c.as_ptr(), access | libc::O_CLOEXEC | libc::O_NOCTTY) };
        if fd < 0 {
            return Err(os("open"));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Self::from_owned(unsafe { OwnedFd::from_raw_fd(fd) }, mode)
    }

    /// Adopts a caller's descriptor: duplicates it (the caller keeps and may
    /// close its own) after checking that it is a regular file open for
    /// `mode`.
    pub fn adopt(fd: BorrowedFd<'_>, mode: FileMode) -> Result<Entry, FileError> {
        // SAFETY: F_GETFL on a descriptor the caller vouches is open.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if fl < 0 {
            return Err(os("fcntl(F_GETFL)"));
        }
        match (mode, fl & libc::O_ACCMODE) {
            (FileMode::ReadOnly, libc::O_RDONLY | libc::O_RDWR) | (FileMode::ReadWrite, libc::O_RDWR) => {}
            (FileMode::ReadOnly, _) => return Err(FileError::ModeMismatch("reading")),
            (FileMode::ReadWrite, _) => return Err(FileError::ModeMismatch("reading and writing")),
        }
        if fl & libc::O_DIRECT != 0 {
            return Err(FileError::Unsupported("O_DIRECT"));
        }
        if fl & libc::O_SYNC == libc::O_SYNC {
            return Err(FileError::Unsupported("O_SYNC"));
        }
        let dup = fd.try_clone_to_owned().map_err(|e| FileError::Os { what: "dup", err: e.to_string() })?;
        Self::from_owned(dup, mode)
    }

    fn from_owned(fd: OwnedFd, mode: FileMode) -> Result<Entry, FileError> {
        // SAFETY: fstat into a zeroed struct for an owned descriptor.
        let st = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(os("fstat"));
            }
            st
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(FileError::NotRegular);
        }
        Ok(Entry {
            fd,
            mode,
            dev: st.st_dev,
            ino: st.st_ino,
            state: Mutex::new(Admission::default()),
            drained: Condvar::new(),
        })
    }

    /// The mode it was opened in.
    pub fn mode(&self) -> FileMode {
        self.mode
    }

    /// Device and inode: which file this is, whatever descriptor numbers do.
    pub fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// The file's current size.
    pub fn len(&self) -> Result<u64, FileError> {
        // SAFETY: as in `from_owned`.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(self.fd.as_raw_fd(), &mut st) != 0 {
                return Err(os("fstat"));
            }
            Ok(st.st_size as u64)
        }
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> Result<bool, FileError> {
        Ok(self.len()? == 0)
    }

    /// Closed: no new I/O.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// I/O calls admitted and not yet finished.
    pub fn in_flight(&self) -> u64 {
        self.state.lock().active
    }

    fn admit(&self) -> Result<Admitted<'_>, FileError> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(FileError::Closed);
        }
        s.active += 1;
        Ok(Admitted(self))
    }

    /// Fences new I/O at once, then waits up to `timeout` for admitted I/O
    /// to drain. The descriptor itself is closed when the Entry is dropped.
    pub fn close(&self, timeout: Duration) -> Result<(), FileError> {
        let deadline = crate::time::deadline_after(timeout);
        let mut s = self.state.lock();
        s.closed = true;
        while s.active > 0 {
            if self.drained.wait_until(&mut s, deadline).timed_out() && s.active > 0 {
                return Err(FileError::DrainTimeout);
            }
        }
        Ok(())
    }
}

/// Direction of a file transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileOp {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

/// One descriptor pair: `len` bytes of memory at `mem` and of the file at
/// `file_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileSpan {
    /// Memory address.
    pub mem: *mut u8,
    /// Bytes.
    pub len: u64,
    /// File offset.
    pub file_offset: u64,
}

/// What a file transfer did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FileOutcome {
    /// Bytes landed contiguously from the first span on (a read that met
    /// the end of the file inside a span stops the prefix there).
    pub prefix: u64,
    /// All bytes landed, in any span.
    pub bytes: u64,
    /// Vectored operations issued (adjacent file extents share one).
    pub operations: u64,
    /// The first I/O error, if any; `prefix` and `bytes` still count what
    /// landed before and around it.
    pub error: Option<FileError>,
}

/// Spans per vectored operation (the kernel's `IOV_MAX`).
const MAX_IOV: usize = 1024;

/// io_uring file I/O. One ring, used by one call at a time.
pub struct FileIo {
    ring: Mutex<io_uring::IoUring>,
    depth: u32,
}

impl std::fmt::Debug for FileIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileIo").field("depth", &self.depth).finish()
    }
}

struct Group {
    first: usize,
    count: usize,
    file_offset: u64,
    len: u64,
}

impl FileIo {
    /// A ring with `depth` entries (operations in flight at once).
    pub fn new(depth: u32) -> Result<FileIo, FileError> {
        let ring = io_uring::IoUring::new(depth.max(1))
            .map_err(|e| FileError::Os { what: "io_uring_setup", err: e.to_string() })?;
        Ok(FileIo { ring: Mutex::new(ring), depth: depth.max(1) })
    }

    /// Moves the spans, in order, between memory and `entry`. Adjacent file
    /// extents (each span starting where the previous ended) become one
    /// vectored operation. Everything is checked before any I/O: the mode,
    /// and offset and length arithmetic. A READ that meets the end of the
    /// file reports exactly the bytes that landed; memory beyond them is
    /// not written. An error returned means nothing was done; an I/O error
    /// after submission is in [`FileOutcome::error`], with the bytes that
    /// landed.
    ///
    /// # Safety
    /// Every span's memory must be valid for the call: readable for a
    /// WRITE, writable (and not otherwise accessed) for a READ.
    pub unsafe fn run(&self, entry: &Entry, op: FileOp, spans: &[FileSpan]) -> Result<FileOutcome, FileError> {
        if op == FileOp::Write && entry.mode == FileMode::ReadOnly {
            return Err(FileError::ModeMismatch("writing"));
        }
        let mut groups: Vec<Group> = Vec::new();
        for (i, s) in spans.iter().enumerate() {
            let end = s.file_offset.checked_add(s.len).filter(|e| *e <= i64::MAX as u64);
            if s.len == 0 || end.is_none() || s.len > isize::MAX as u64 || s.mem.is_null() {
                return Err(FileError::OutOfRange(format!(
                    "span {i}: {} bytes at file offset {}",
                    s.len, s.file_offset
                )));
            }
            match groups.last_mut() {
                Some(g)
                    if g.file_offset + g.len == s.file_offset
                        && g.count < MAX_IOV
                        && g.len.checked_add(s.len).is_some_and(|l| l <= i32::MAX as u64) =>
                {
                    g.count += 1;
                    g.len += s.len;
                }
                _ => groups.push(Group { first: i, count: 1, file_offset: s.file_offset, len: s.len }),
            }
        }
        let _admitted = entry.admit()?;
        let iovecs: Vec<libc::iovec> =
            spans.iter().map(|s| libc::iovec { iov_base: s.mem.cast(), iov_len: s.len as usize }).collect();
        let mut done = vec![0u64; groups.len()];
        let mut ring = self.ring.lock();
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut failure: Option<FileError> = None;
        while next < groups.len() || in_flight > 0 {
            while next < groups.len() && in_flight < self.depth as usize && failure.is_none() {
                let g = &groups[next];
                let fd = io_uring::types::Fd(entry.fd.as_raw_fd());
                let iov = iovecs[g.first..].as_ptr();
                let sqe = match op {
                    FileOp::Read => io_uring::opcode::Readv::new(fd, iov, g.count as u32).offset(g.file_offset).build(),
                    FileOp::Write => {
                        io_uring::opcode::Writev::new(fd, iov, g.count as u32).offset(g.file_offset).build()
                    }
                }
                .user_data(next as u64);
                // SAFETY: the iovecs and the memory they name outlive the
                // operation: we wait for every submitted completion below
                // before returning (the caller vouches for the memory).
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    break; // the submission queue is full: reap first
                }
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // Nothing more can be submitted or reaped safely: wait for
                // what is in flight the only way left (the memory must not
                // be released under the kernel).
                failure.get_or_insert(FileError::Os { what: "io_uring_enter", err: e.to_string() });
                continue;
            }
            for cqe in ring.completion() {
                in_flight -= 1;
                let g = cqe.user_data() as usize;
                match cqe.result() {
                    r if r >= 0 => done[g] = r as u64,
                    r => {
                        let err = std::io::Error::from_raw_os_error(-r).to_string();
                        failure.get_or_insert(FileError::Os { what: "file I/O", err });
                    }
                }
            }
        }
        drop(ring);
        let mut out = FileOutcome { operations: next as u64, ..FileOutcome::default() };
        let mut contiguous = true;
        for (g, d) in groups.iter().zip(&done) {
            out.bytes += d;
            if contiguous {
                out.prefix += d;
                contiguous = *d == g.len;
            }
        }
        out.error = failure;
        Ok(out)
    }
}
