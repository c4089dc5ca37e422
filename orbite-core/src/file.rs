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
//!
//! Files opened or adopted with `O_DIRECT` bypass the page cache: spans
//! whose memory address, file offset and length are multiples of the
//! file's direct-I/O alignment ([`DioAlign`]) go to the kernel as they are;
//! the others go through aligned buffers of a bounded [`BouncePool`], with
//! the partial blocks at a WRITE's edges read, patched and written back
//! (read-modify-write). `O_SYNC` and `O_DSYNC` stay on the descriptor, so
//! every write the kernel completes is durable as the flag says.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::charge::{Charge, Counter, Counters};

/// How a file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileMode {
    /// Reads only: a WRITE into it is refused before any I/O.
    ReadOnly,
    /// Reads and writes.
    ReadWrite,
}

/// Flags that change durability or caching. For [`Entry::open`] they are
/// what the file is opened with; an adopted descriptor keeps its own, and
/// [`Entry::flags`] reports them either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct OpenFlags {
    /// Bypass the page cache (`O_DIRECT`): aligned spans go straight to the
    /// device, the others through the bounce pool.
    pub direct: bool,
    /// Every write durable, data and metadata, when it completes
    /// (`O_SYNC`): a WRITE task reports only after the device has it.
    pub sync: bool,
    /// Every write's data durable when it completes (`O_DSYNC`), and the
    /// metadata needed to read it back (a grown size; not the mtime).
    pub dsync: bool,
}

/// The alignment direct I/O needs on a file: the memory address (and each
/// length) a multiple of `mem`, the file offset and length multiples of
/// `offset`. From `statx` (`STATX_DIOALIGN`) where the kernel and the
/// file system give it; else the device's logical block size and DMA
/// alignment from sysfs; else 4096 for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DioAlign {
    /// Memory alignment in bytes (a power of two).
    pub mem: u32,
    /// File offset and length alignment in bytes (a power of two).
    pub offset: u32,
    /// Where the figures came from: `"statx"`, `"sysfs"` or `"default"`.
    pub source: &'static str,
}

impl DioAlign {
    fn of(&self, mem: u64, len: u64, file_offset: u64) -> bool {
        let (m, o) = (self.mem as u64, self.offset as u64);
        mem % m == 0 && len % m == 0 && len % o == 0 && file_offset % o == 0
    }

    /// The alignment bounce buffers and their windows keep: both figures
    /// and a page.
    fn block(&self) -> u64 {
        (self.mem.max(self.offset) as u64).max(4096)
    }
}

/// What `fstat` says about a file, as NIXL's file backends report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileFacts {
    /// Size in bytes.
    pub size: u64,
    /// `st_mode`: the file type and permission bits.
    pub mode: u32,
    /// Last modification, seconds since the epoch.
    pub mtime_sec: i64,
    /// And its nanoseconds.
    pub mtime_nsec: u32,
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
    /// The bounce pool for unaligned direct I/O is at its limit.
    #[error("no bounce buffer: {held} of {limit} bytes in use, {wanted} more wanted")]
    NoBounce {
        /// Bytes of bounce buffers alive.
        held: u64,
        /// The pool's limit.
        limit: u64,
        /// The buffer wanted.
        wanted: u64,
    },
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

/// The descriptor's status flags (`F_GETFL`).
fn getfl(fd: i32) -> Result<i32, FileError> {
    // SAFETY: F_GETFL on a descriptor open for the call.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    (fl >= 0).then_some(fl).ok_or_else(|| os("fcntl(F_GETFL)"))
}

fn fstat(fd: i32) -> Result<libc::stat, FileError> {
    // SAFETY: fstat into a zeroed struct; `fd` is open for the call.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return Err(os("fstat"));
        }
        Ok(st)
    }
}

/// The direct-I/O alignment of open file `fd` ([`DioAlign`]).
fn dio_align(fd: i32, st: &libc::stat) -> DioAlign {
    // SAFETY: statx of the descriptor itself (empty path, AT_EMPTY_PATH)
    // into a zeroed struct.
    let stx = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        let r = libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx);
        (r == 0).then_some(stx)
    };
    if let Some(x) = stx.filter(|x| x.stx_mask & libc::STATX_DIOALIGN != 0 && x.stx_dio_offset_align > 0) {
        let pow2 = |v: u32| if v.is_power_of_two() { v } else { v.next_power_of_two() };
        return DioAlign {
            mem: pow2(x.stx_dio_mem_align.max(1)),
            offset: pow2(x.stx_dio_offset_align),
            source: "statx",
        };
    }
    let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
    let queue = |leaf: &str| -> Option<u32> {
        // A partition has no queue of its own: its disk's is one up.
        [
            format!("/sys/dev/block/{major}:{minor}/queue/{leaf}"),
            format!("/sys/dev/block/{major}:{minor}/../queue/{leaf}"),
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
    };
    match queue("logical_block_size").filter(|b: &u32| b.is_power_of_two()) {
        Some(block) => {
            let mem = queue("dma_alignment").map_or(block, |a| (a.saturating_add(1)).next_power_of_two()).min(block);
            DioAlign { mem, offset: block, source: "sysfs" }
        }
        None => DioAlign { mem: 4096, offset: 4096, source: "default" },
    }
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
    flags: OpenFlags,
    /// Set for `O_DIRECT`.
    dio: Option<DioAlign>,
    dev: u64,
    ino: u64,
    state: Mutex<Admission>,
    drained: Condvar,
    /// Direct writes of this Entry hold it shared; a read-modify-write of
    /// partial blocks holds it alone, so that no write of this engine
    /// lands between its read and its write (nor between its write and the
    /// truncation that takes back the padding it wrote past the end).
    edges: RwLock<()>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("mode", &self.mode)
            .field("flags", &self.flags)
            .field("dio", &self.dio)
            .field("dev", &self.dev)
            .field("ino", &self.ino)
            .finish()
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
    /// Opens `path` (absolute) in `mode` with `flags`. A file system that
    /// refuses `O_DIRECT` fails the open (`EINVAL`), as the kernel says.
    pub fn open(path: &Path, mode: FileMode, flags: OpenFlags) -> Result<Entry, FileError> {
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
        let mut extra = 0;
        if flags.direct {
            extra |= libc::O_DIRECT;
        }
        if flags.sync {
            extra |= libc::O_SYNC;
        } else if flags.dsync {
            extra |= libc::O_DSYNC;
        }
        // SAFETY: a NUL-terminated path; the returned descriptor is owned.
        let fd = unsafe { libc::open(c.as_ptr(), access | extra | libc::O_CLOEXEC | libc::O_NOCTTY) };
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
        // The caller vouches that the descriptor is open.
        match (mode, getfl(fd.as_raw_fd())? & libc::O_ACCMODE) {
            (FileMode::ReadOnly, libc::O_RDONLY | libc::O_RDWR) | (FileMode::ReadWrite, libc::O_RDWR) => {}
            (FileMode::ReadOnly, _) => return Err(FileError::ModeMismatch("reading")),
            (FileMode::ReadWrite, _) => return Err(FileError::ModeMismatch("reading and writing")),
        }
        let dup = fd.try_clone_to_owned().map_err(|e| FileError::Os { what: "dup", err: e.to_string() })?;
        Self::from_owned(dup, mode)
    }

    fn from_owned(fd: OwnedFd, mode: FileMode) -> Result<Entry, FileError> {
        let st = fstat(fd.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(FileError::NotRegular);
        }
        // The descriptor's own flags (the open file description's, which
        // the caller's descriptor shares) are what the kernel applies.
        let fl = getfl(fd.as_raw_fd())?;
        let flags = OpenFlags {
            direct: fl & libc::O_DIRECT != 0,
            sync: fl & libc::O_SYNC == libc::O_SYNC,
            dsync: fl & libc::O_DSYNC != 0,
        };
        let dio = flags.direct.then(|| dio_align(fd.as_raw_fd(), &st));
        Ok(Entry {
            fd,
            mode,
            flags,
            dio,
            dev: st.st_dev,
            ino: st.st_ino,
            state: Mutex::new(Admission::default()),
            drained: Condvar::new(),
            edges: RwLock::new(()),
        })
    }

    /// The flags the kernel applies to this file's I/O.
    pub fn flags(&self) -> OpenFlags {
        self.flags
    }

    /// The direct-I/O alignment, for an `O_DIRECT` file.
    pub fn dio_align(&self) -> Option<DioAlign> {
        self.dio
    }

    /// Size, mode and modification time, from `fstat` now.
    pub fn facts(&self) -> Result<FileFacts, FileError> {
        let st = fstat(self.fd.as_raw_fd())?;
        Ok(FileFacts {
            size: st.st_size as u64,
            mode: st.st_mode,
            mtime_sec: st.st_mtime,
            mtime_nsec: st.st_mtime_nsec as u32,
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
        Ok(fstat(self.fd.as_raw_fd())?.st_size as u64)
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

/// The most bytes one operation on a direct file moves: longer runs of
/// adjacent extents, and longer spans, become several operations in
/// flight at once.
pub const DIRECT_OP_BYTES: u64 = 1 << 20;

/// The least bytes of one route task on a direct file. A worker keeps one
/// task's operations in flight and waits for them all, so a task of one
/// `task_bytes` (1 MiB by default) would leave a single operation at the
/// device per worker. Sixteen per worker keep an NVMe queue busy, as the
/// page cache's write-back and read-ahead do for buffered files.
pub const DIRECT_TASK_BYTES: u64 = 16 * DIRECT_OP_BYTES;

/// Bytes of one bounce buffer: how much of an unaligned direct span moves
/// per read or write (more when the file's alignment is larger).
pub const BOUNCE_CHUNK: u64 = 1 << 20;

/// The limit of a [`FileIo`]'s own bounce pool ([`FileIo::new`]).
pub const DEFAULT_BOUNCE_LIMIT: u64 = 64 << 20;

/// Aligned host buffers for direct I/O of spans that are not aligned.
///
/// Each buffer alive is charged to `staging_buffers`/`staging_bytes`
/// within the pool's limit (an engine's pool shares its counters and
/// `max_staging_bytes` with CUDA staging); a task holds one buffer while
/// it runs, and free ones are kept for reuse until [`BouncePool::clear`].
pub struct BouncePool {
    free: Mutex<Vec<BounceBuf>>,
    counters: Arc<Counters>,
    limit: u64,
}

impl std::fmt::Debug for BouncePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BouncePool").field("free", &self.free.lock().len()).field("limit", &self.limit).finish()
    }
}

struct BounceBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
    _charge: Charge,
}

// SAFETY: a plain heap allocation owned by the buffer; whoever holds the
// buffer is its only user.
unsafe impl Send for BounceBuf {}

impl Drop for BounceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `BouncePool::take` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A buffer taken from a [`BouncePool`]; back in it on drop.
struct Bounce<'a> {
    pool: &'a BouncePool,
    buf: Option<BounceBuf>,
}

impl Bounce<'_> {
    fn slice(&mut self, len: usize) -> &mut [u8] {
        let b = self.buf.as_ref().expect("held until drop");
        assert!(len <= b.layout.size());
        // SAFETY: `len` bytes of an allocation this value holds alone.
        unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), len) }
    }
}

impl Drop for Bounce<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.free.lock().push(b);
        }
    }
}

impl BouncePool {
    /// A pool with counters of its own, at most `limit` bytes alive.
    pub fn new(limit: u64) -> Arc<BouncePool> {
        Self::charged(Arc::new(Counters::default()), limit)
    }

    /// A pool charging an engine's counters.
    pub(crate) fn charged(counters: Arc<Counters>, limit: u64) -> Arc<BouncePool> {
        Arc::new(BouncePool { free: Mutex::new(Vec::new()), counters, limit })
    }

    /// Bytes of this pool's buffers alive (with an engine's pool, CUDA
    /// staging buffers too).
    pub fn held_bytes(&self) -> u64 {
        self.counters.get(Counter::StagingBytes)
    }

    /// Frees every buffer not in use.
    pub fn clear(&self) {
        let items = std::mem::take(&mut *self.free.lock());
        drop(items);
    }

    fn take(&self, len: u64, align: u64) -> Result<Bounce<'_>, FileError> {
        let found = {
            let mut free = self.free.lock();
            free.iter()
                .rposition(|b| b.layout.size() as u64 >= len && b.layout.align() as u64 >= align)
                .map(|at| free.remove(at))
        };
        let buf = match found {
            Some(b) => b,
            None => {
                let bound = Some((crate::types::Resource::StagingBytes, self.limit));
                let items = [(Counter::StagingBuffers, 1, None), (Counter::StagingBytes, len, bound)];
                let charge = match Charge::try_new(&self.counters, items) {
                    Ok(c) => c,
                    Err(_) => {
                        self.clear(); // free buffers of other sizes make room
                        Charge::try_new(&self.counters, items).map_err(|_| FileError::NoBounce {
                            held: self.held_bytes(),
                            limit: self.limit,
                            wanted: len,
                        })?
                    }
                };
                let layout = std::alloc::Layout::from_size_align(len as usize, align as usize)
                    .map_err(|_| FileError::OutOfRange(format!("a bounce buffer of {len} bytes aligned to {align}")))?;
                // SAFETY: a layout of nonzero size.
                let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) })
                    .ok_or(FileError::Os { what: "bounce buffer", err: "out of memory".into() })?;
                BounceBuf { ptr, layout, _charge: charge }
            }
        };
        Ok(Bounce { pool: self, buf: Some(buf) })
    }
}

/// io_uring file I/O. One ring, used by one call at a time.
pub struct FileIo {
    ring: Mutex<io_uring::IoUring>,
    depth: u32,
    bounce: Arc<BouncePool>,
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
    /// One span of a direct file that is not aligned: moved through a
    /// bounce buffer.
    bounce: bool,
}

impl FileIo {
    /// A ring with `depth` entries (operations in flight at once), and a
    /// bounce pool of its own ([`DEFAULT_BOUNCE_LIMIT`]).
    pub fn new(depth: u32) -> Result<FileIo, FileError> {
        let ring = io_uring::IoUring::new(depth.max(1))
            .map_err(|e| FileError::Os { what: "io_uring_setup", err: e.to_string() })?;
        Ok(FileIo { ring: Mutex::new(ring), depth: depth.max(1), bounce: BouncePool::new(DEFAULT_BOUNCE_LIMIT) })
    }

    /// This ring's own bounce pool.
    pub fn bounce_pool(&self) -> &Arc<BouncePool> {
        &self.bounce
    }

    /// [`FileIo::run_with`] this ring's own bounce pool.
    ///
    /// # Safety
    /// As for [`FileIo::run_with`].
    pub unsafe fn run(&self, entry: &Entry, op: FileOp, spans: &[FileSpan]) -> Result<FileOutcome, FileError> {
        // SAFETY: the caller's contract.
        unsafe { self.run_with(entry, op, spans, &self.bounce) }
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
    /// On an `O_DIRECT` file, spans aligned to its [`DioAlign`] go to the
    /// kernel as they are; each other span moves through a buffer of
    /// `bounce` ([`BOUNCE_CHUNK`] at a time), after the aligned ones. A
    /// WRITE that starts or ends inside a block first reads that block,
    /// and one that ends inside the file's last block takes back the
    /// padding with `ftruncate`; no other write of this Entry runs
    /// meanwhile. Writes by other processes to the same blocks are not
    /// fenced, as with any read-modify-write.
    ///
    /// # Safety
    /// Every span's memory must be valid for the call: readable for a
    /// WRITE, writable (and not otherwise accessed) for a READ.
    pub unsafe fn run_with(
        &self,
        entry: &Entry,
        op: FileOp,
        spans: &[FileSpan],
        bounce: &BouncePool,
    ) -> Result<FileOutcome, FileError> {
        if op == FileOp::Write && entry.mode == FileMode::ReadOnly {
            return Err(FileError::ModeMismatch("writing"));
        }
        for (i, s) in spans.iter().enumerate() {
            let end = s.file_offset.checked_add(s.len).filter(|e| *e <= i64::MAX as u64);
            if s.len == 0 || end.is_none() || s.len > isize::MAX as u64 || s.mem.is_null() {
                return Err(FileError::OutOfRange(format!(
                    "span {i}: {} bytes at file offset {}",
                    s.len, s.file_offset
                )));
            }
        }
        // A direct file's bytes go to the device as they are: operations of
        // at most DIRECT_OP_BYTES, many in flight, keep its queue busy
        // where one long operation would run alone.
        let split: Vec<FileSpan>;
        let spans = match entry.dio {
            Some(_) if spans.iter().any(|s| s.len > DIRECT_OP_BYTES) => {
                split = spans
                    .iter()
                    .flat_map(|s| {
                        // Checked above: no offset overflows.
                        (0..s.len.div_ceil(DIRECT_OP_BYTES)).map(move |k| {
                            let at = k * DIRECT_OP_BYTES;
                            FileSpan {
                                mem: s.mem.wrapping_add(at as usize),
                                len: (s.len - at).min(DIRECT_OP_BYTES),
                                file_offset: s.file_offset + at,
                            }
                        })
                    })
                    .collect();
                &split[..]
            }
            _ => spans,
        };
        let max_op = if entry.dio.is_some() { DIRECT_OP_BYTES } else { i32::MAX as u64 };
        let mut groups: Vec<Group> = Vec::new();
        for (i, s) in spans.iter().enumerate() {
            let bounced = entry.dio.is_some_and(|d| !d.of(s.mem as u64, s.len, s.file_offset));
            match groups.last_mut() {
                Some(g)
                    if !bounced
                        && !g.bounce
                        && g.file_offset + g.len == s.file_offset
                        && g.count < MAX_IOV
                        && g.len.checked_add(s.len).is_some_and(|l| l <= max_op) =>
                {
                    g.count += 1;
                    g.len += s.len;
                }
                _ => groups.push(Group { first: i, count: 1, file_offset: s.file_offset, len: s.len, bounce: bounced }),
            }
        }
        let _admitted = entry.admit()?;
        let mut done = vec![0u64; groups.len()];
        let mut failure: Option<FileError> = None;
        let mut operations = 0u64;
        {
            // Direct writes keep read-modify-writes of this Entry out.
            let _shared = (entry.dio.is_some() && op == FileOp::Write).then(|| entry.edges.read());
            operations += self.ring_groups(entry, op, spans, &groups, &mut done, &mut failure);
        }
        for (g, d) in groups.iter().zip(done.iter_mut()).filter(|(g, _)| g.bounce) {
            if failure.is_some() {
                break;
            }
            let dio = entry.dio.expect("only direct files bounce");
            failure = bounced(entry, dio, op, &spans[g.first], bounce, d).err();
            operations += 1;
        }
        let mut out = FileOutcome { operations, ..FileOutcome::default() };
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

    /// The groups that are not bounced, through the ring: fills `done` and
    /// the first failure, returns the operations submitted.
    fn ring_groups(
        &self,
        entry: &Entry,
        op: FileOp,
        spans: &[FileSpan],
        groups: &[Group],
        done: &mut [u64],
        failure: &mut Option<FileError>,
    ) -> u64 {
        let iovecs: Vec<libc::iovec> =
            spans.iter().map(|s| libc::iovec { iov_base: s.mem.cast(), iov_len: s.len as usize }).collect();
        let mut ring = self.ring.lock();
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut submitted = 0u64;
        loop {
            while next < groups.len() && in_flight < self.depth as usize && failure.is_none() {
                let g = &groups[next];
                if g.bounce {
                    next += 1;
                    continue;
                }
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
                submitted += 1;
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
        submitted
    }
}

/// Reads up to `buf.len()` bytes at `offset` (a block boundary) of a
/// direct file: fewer only at the end of the file.
fn pread_blocks(fd: i32, buf: &mut [u8], offset: u64, block: u64) -> Result<usize, FileError> {
    let mut got = 0usize;
    while got < buf.len() {
        // SAFETY: the rest of `buf`, writable, at an aligned address.
        let r = unsafe {
            libc::pread(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got, (offset + got as u64) as libc::off_t)
        };
        match r {
            0 => break,
            r if r > 0 => {
                got += r as usize;
                if got as u64 % block != 0 {
                    break; // short inside a block: the end of the file
                }
            }
            _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            _ => return Err(os("direct read")),
        }
    }
    Ok(got)
}

/// Writes all of `buf` (whole blocks) at `offset` (a block boundary) of a
/// direct file.
fn pwrite_blocks(fd: i32, buf: &[u8], offset: u64, block: u64) -> Result<(), FileError> {
    let mut put = 0usize;
    while put < buf.len() {
        // SAFETY: the rest of `buf`, readable, at an aligned address.
        let r = unsafe {
            libc::pwrite(fd, buf[put..].as_ptr().cast(), buf.len() - put, (offset + put as u64) as libc::off_t)
        };
        match r {
            r if r > 0 && (put + r as usize) as u64 % block == 0 => put += r as usize,
            r if r >= 0 => {
                return Err(FileError::Os { what: "direct write", err: format!("short write of {r} bytes") });
            }
            _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            _ => return Err(os("direct write")),
        }
    }
    Ok(())
}

/// One unaligned span of a direct file through a bounce buffer: `done`
/// (0 on entry) counts the bytes that landed (from the span's start on);
/// the error that stopped it.
fn bounced(
    entry: &Entry,
    dio: DioAlign,
    op: FileOp,
    s: &FileSpan,
    pool: &BouncePool,
    done: &mut u64,
) -> Result<(), FileError> {
    let block = dio.block();
    let chunk = BOUNCE_CHUNK.max(2 * block);
    let mut buf = pool.take(chunk, block)?;
    let fd = entry.fd.as_raw_fd();
    let end_of_span = s.file_offset + s.len;
    while *done < s.len {
        let p = s.file_offset + *done;
        let a = p / block * block;
        let end = end_of_span.min(a + chunk);
        let n = end - p;
        let b = end.div_ceil(block) * block;
        let window = buf.slice((b - a) as usize);
        let at = (p - a) as usize;
        // SAFETY (both arms): the caller vouches for the span's memory;
        // `done + n` <= `s.len`.
        let mem = unsafe { s.mem.add(*done as usize) };
        match op {
            FileOp::Read => {
                let got = pread_blocks(fd, window, a, block)?;
                let landed = (got.saturating_sub(at) as u64).min(n);
                // SAFETY: `landed` bytes into the span's memory.
                unsafe { std::ptr::copy_nonoverlapping(window[at..].as_ptr(), mem, landed as usize) };
                *done += landed;
                if landed < n {
                    break; // the end of the file
                }
            }
            FileOp::Write => {
                let partial = p != a || end != b;
                // A partial block is read, patched and written back: no
                // other write of this Entry may land in between.
                let _alone = partial.then(|| entry.edges.write());
                let _shared = (!partial).then(|| entry.edges.read());
                let size = if partial { entry.len()? } else { 0 };
                let len = window.len();
                let mut edge = |from: usize| -> Result<(), FileError> {
                    let blk = &mut window[from..from + block as usize];
                    let got = pread_blocks(fd, blk, a + from as u64, block)?;
                    blk[got..].fill(0);
                    Ok(())
                };
                if p != a {
                    edge(0)?;
                }
                if end != b && (p == a || len as u64 > block) {
                    edge(len - block as usize)?;
                }
                // SAFETY: `n` bytes of the span's memory, readable.
                unsafe { std::ptr::copy_nonoverlapping(mem, window[at..].as_mut_ptr(), n as usize) };
                pwrite_blocks(fd, window, a, block)?;
                if partial && size < b {
                    // The padding past the old end is not the caller's.
                    // SAFETY: ftruncate of an owned descriptor.
                    if unsafe { libc::ftruncate(fd, size.max(end) as libc::off_t) } != 0 {
                        return Err(os("ftruncate"));
                    }
                }
                *done += n;
            }
        }
    }
    Ok(())
}
