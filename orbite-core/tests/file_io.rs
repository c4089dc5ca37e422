//! Local files with io_uring (N09 building blocks): on a tmpfs (/dev/shm)
//! and on the disk under /tmp, both directions, fragments, guard bytes,
//! EOF inside a fragment, adjacent extents merged, fd adoption and reuse,
//! close during I/O, and refusals before any I/O.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use orbite_core::file::{Entry, FileError, FileIo, FileMode, FileOp, FileSpan, OpenFlags};

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp(dir: &str, name: &str, bytes: &[u8]) -> TempFile {
    let p = PathBuf::from(dir).join(format!("orbite-file-test-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    TempFile(p)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn span(buf: &mut [u8], off: usize, len: usize, file_offset: u64) -> FileSpan {
    FileSpan { mem: buf[off..].as_mut_ptr(), len: len as u64, file_offset }
}

const DIRS: [&str; 2] = ["/dev/shm", "/tmp"];

#[test]
fn fragments_both_directions_with_guards_on_tmpfs_and_disk() {
    let io = FileIo::new(8).unwrap();
    for dir in DIRS {
        let original = pattern(1 << 20, 7);
        let f = temp(dir, "frag", &original);
        let e = Entry::open(&f.0, FileMode::ReadWrite, OpenFlags::default()).unwrap();
        // READ: three fragments of the file into scattered memory.
        let mut mem = vec![0xEEu8; 1 << 20];
        let spans = [span(&mut mem, 10, 5000, 100), span(&mut mem, 9000, 3, 7), span(&mut mem, 20000, 65536, 300_000)];
        // SAFETY: `mem` outlives the call and is not otherwise used.
        let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
        assert_eq!((out.prefix, out.bytes, out.error), (70539, 70539, None), "{dir}");
        let mut want = vec![0xEEu8; 1 << 20];
        want[10..5010].copy_from_slice(&original[100..5100]);
        want[9000..9003].copy_from_slice(&original[7..10]);
        want[20000..85536].copy_from_slice(&original[300_000..365_536]);
        assert!(mem == want, "{dir}: bytes or guards differ");
        // WRITE: fragments of memory into the file, elsewhere untouched.
        let mut src = pattern(8192, 99);
        let spans = [span(&mut src, 0, 4096, 500_000), span(&mut src, 5000, 100, 1)];
        // SAFETY: as above.
        let out = unsafe { io.run(&e, FileOp::Write, &spans) }.unwrap();
        assert_eq!((out.prefix, out.error), (4196, None));
        let now = std::fs::read(&f.0).unwrap();
        let mut want = original.clone();
        want[500_000..504_096].copy_from_slice(&src[..4096]);
        want[1..101].copy_from_slice(&src[5000..5100]);
        assert!(now == want, "{dir}: file bytes or guards differ");
    }
}

#[test]
fn adjacent_file_extents_become_one_vectored_operation() {
    let io = FileIo::new(4).unwrap();
    let f = temp("/dev/shm", "adj", &pattern(65536, 1));
    let e = Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap();
    let mut mem = vec![0u8; 65536];
    // File 0..100, 100..300 adjacent; 1000.. not; then 1100.. adjacent again.
    let spans = [
        span(&mut mem, 5000, 100, 0),
        span(&mut mem, 0, 200, 100),
        span(&mut mem, 9000, 100, 1000),
        span(&mut mem, 700, 50, 1100),
    ];
    // SAFETY: as above.
    let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
    assert_eq!((out.operations, out.prefix), (2, 450));
    let file = pattern(65536, 1);
    assert_eq!(&mem[5000..5100], &file[0..100]);
    assert_eq!(&mem[0..200], &file[100..300]);
    assert_eq!(&mem[700..750], &file[1100..1150]);
}

#[test]
fn eof_inside_a_fragment_reports_exactly_what_landed() {
    let io = FileIo::new(4).unwrap();
    for dir in DIRS {
        let f = temp(dir, "eof", &pattern(10_000, 3));
        let e = Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap();
        let mut mem = vec![0xAAu8; 16384];
        // One vectored read of 3 x 4 KiB from offset 0: EOF at 10 000.
        let spans = [span(&mut mem, 0, 4096, 0), span(&mut mem, 4096, 4096, 4096), span(&mut mem, 8192, 4096, 8192)];
        // SAFETY: as above.
        let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
        assert_eq!((out.prefix, out.bytes, out.error), (10_000, 10_000, None), "{dir}");
        assert_eq!(&mem[..10_000], &pattern(10_000, 3)[..]);
        assert!(mem[10_000..].iter().all(|b| *b == 0xAA), "{dir}: nothing beyond EOF is written");
        // A fragment wholly past EOF lands nothing and stops the prefix.
        let mut mem2 = vec![0xAAu8; 8192];
        let spans = [span(&mut mem2, 0, 4096, 20_000), span(&mut mem2, 4096, 100, 0)];
        // SAFETY: as above.
        let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
        assert_eq!((out.prefix, out.bytes), (0, 100), "{dir}");
        assert!(mem2[..4096].iter().all(|b| *b == 0xAA));
    }
}

#[test]
fn adopted_descriptor_is_a_checked_duplicate_and_fd_reuse_never_reaches_it() {
    let io = FileIo::new(2).unwrap();
    let a = temp("/tmp", "adopt-a", &pattern(4096, 10));
    let b = temp("/tmp", "adopt-b", &pattern(4096, 20));
    let fa = std::fs::File::open(&a.0).unwrap();
    let e = Entry::adopt(fa.as_fd(), FileMode::ReadOnly).unwrap();
    assert_eq!(
        Entry::adopt(fa.as_fd(), FileMode::ReadWrite).unwrap_err(),
        FileError::ModeMismatch("reading and writing"),
        "a read-only descriptor cannot be adopted for writing"
    );
    let identity = e.identity();
    drop(fa); // the caller closes its descriptor...
    let fb = std::fs::File::open(&b.0).unwrap(); // ...and the number is reused
    let mut mem = vec![0u8; 4096];
    // SAFETY: as above.
    let out = unsafe { io.run(&e, FileOp::Read, &[span(&mut mem, 0, 4096, 0)]) }.unwrap();
    assert_eq!(out.prefix, 4096);
    assert_eq!(mem, pattern(4096, 10), "the Entry still reads file A");
    assert_eq!(e.identity(), identity);
    assert_ne!(Entry::adopt(fb.as_fd(), FileMode::ReadOnly).unwrap().identity(), identity);
    // Not a regular file.
    let dir = std::fs::File::open("/tmp").unwrap();
    assert_eq!(Entry::adopt(dir.as_fd(), FileMode::ReadOnly).unwrap_err(), FileError::NotRegular);
}

#[test]
fn refusals_happen_before_any_io() {
    let io = FileIo::new(2).unwrap();
    let f = temp("/dev/shm", "refuse", &pattern(4096, 5));
    assert!(matches!(
        Entry::open(std::path::Path::new("relative/path"), FileMode::ReadOnly, OpenFlags::default()),
        Err(FileError::InvalidPath(_))
    ));
    let ro = Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap();
    let mut mem = pattern(4096, 77);
    // SAFETY: refused before any I/O.
    let err = unsafe { io.run(&ro, FileOp::Write, &[span(&mut mem, 0, 4096, 0)]) }.unwrap_err();
    assert_eq!(err, FileError::ModeMismatch("writing"));
    let rw = Entry::open(&f.0, FileMode::ReadWrite, OpenFlags::default()).unwrap();
    for bad in [
        FileSpan { mem: mem.as_mut_ptr(), len: 16, file_offset: u64::MAX - 4 },
        FileSpan { mem: mem.as_mut_ptr(), len: 0, file_offset: 0 },
        FileSpan { mem: std::ptr::null_mut(), len: 16, file_offset: 0 },
    ] {
        // SAFETY: refused before any I/O.
        let err = unsafe { io.run(&rw, FileOp::Write, &[span(&mut mem, 0, 16, 0), bad]) }.unwrap_err();
        assert!(matches!(err, FileError::OutOfRange(_)), "{err}");
    }
    assert_eq!(std::fs::read(&f.0).unwrap(), pattern(4096, 5), "nothing was written");
}

#[test]
fn close_fences_new_io_and_waits_for_admitted_io() {
    let f = temp("/tmp", "close", &pattern(32 << 20, 9));
    let e = Arc::new(Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap());
    let reader = {
        let e = e.clone();
        std::thread::spawn(move || {
            let io = FileIo::new(4).unwrap();
            let mut mem = vec![0u8; 32 << 20];
            let spans: Vec<FileSpan> =
                (0..2048).map(|i| span(&mut mem, i * 16384, 16384, (i as u64 * 16384) ^ 0x4000)).collect();
            // SAFETY: `mem` outlives the call.
            let out = unsafe { io.run(&e, FileOp::Read, &spans) };
            (out, mem)
        })
    };
    // Close while the read is admitted: close must wait for it.
    let start = std::time::Instant::now();
    while e.in_flight() == 0 {
        assert!(!reader.is_finished(), "the read finished before it was seen in flight");
        assert!(start.elapsed() < Duration::from_secs(10));
        std::hint::spin_loop();
    }
    e.close(Duration::from_secs(20)).unwrap();
    assert_eq!(e.in_flight(), 0, "close returned with I/O still admitted");
    let (out, mem) = reader.join().unwrap();
    let out = out.unwrap();
    assert_eq!((out.prefix, out.error), (32 << 20, None), "admitted I/O completed");
    assert_eq!(&mem[16384..32768], &pattern(32 << 20, 9)[..16384]);
    let io = FileIo::new(2).unwrap();
    let mut mem = vec![0u8; 16];
    // SAFETY: refused.
    assert_eq!(unsafe { io.run(&e, FileOp::Read, &[span(&mut mem, 0, 16, 0)]) }.unwrap_err(), FileError::Closed);
}

// Through the engine: the file route keeps every lifecycle promise.

use orbite_core::{
    Desc, MemoryRange, Op, OutcomeCode, Permission, RegistrationId, RemoteEffect, Route, Target, TransferEngine,
    TransferSpec,
};

fn engine() -> TransferEngine {
    TransferEngine::from_json(r#"{"local_route_workers": 1, "task_bytes": 65536}"#).unwrap()
}

fn wait(t: &orbite_core::Transfer) -> orbite_core::TransferResult {
    t.wait(Duration::from_secs(20)).result().expect("retired")
}

fn fext(offset: u64, len: u64) -> Desc {
    Desc::new(RegistrationId::from_raw(0), offset, len)
}

#[test]
fn file_route_write_then_read_back_fragmented_with_guards_and_baseline_charges() {
    for dir in DIRS {
        let e = engine();
        let base = e.stats();
        let f = temp(dir, "route", &vec![0x5Au8; 1 << 20]);
        let entry = Arc::new(Entry::open(&f.0, FileMode::ReadWrite, OpenFlags::default()).unwrap());
        let mem = e.allocate_host_memory(1 << 20).unwrap();
        let id = e
            .register_memory_ranges(vec![MemoryRange::host(&mem, 0, 1 << 20, Permission::LocalOnly).unwrap()])
            .unwrap()[0];
        let src = pattern(300_000, 42);
        // SAFETY: nothing else uses the memory now.
        unsafe { mem.write(0, &src) };
        // Two memory fragments to three file extents (one adjacent pair).
        let local = [Desc::new(id, 0, 200_000), Desc::new(id, 200_000, 100_000)];
        let remote = [fext(1000, 150_000), fext(151_000, 50_000), fext(600_000, 100_000)];
        let t = e.prepare(&TransferSpec::new(Op::Write, &local, &remote, Target::File(&entry))).unwrap();
        assert_eq!(t.route().route, Route::File);
        t.post().unwrap();
        let r = wait(&t);
        assert_eq!((r.outcome.code, r.outcome.transferred_prefix), (OutcomeCode::Success, 300_000), "{dir}");
        t.release().unwrap();
        let file = std::fs::read(&f.0).unwrap();
        let mut want = vec![0x5Au8; 1 << 20];
        want[1000..201_000].copy_from_slice(&src[..200_000]);
        want[600_000..700_000].copy_from_slice(&src[200_000..]);
        assert!(file == want, "{dir}: file bytes or guards differ");
        // READ back into different memory.
        let back = e.allocate_host_memory(1 << 20).unwrap();
        let bid = e
            .register_memory_ranges(vec![MemoryRange::host(&back, 0, 1 << 20, Permission::LocalOnly).unwrap()])
            .unwrap()[0];
        let t = e
            .prepare(&TransferSpec::new(Op::Read, &[Desc::new(bid, 7, 300_000)], &remote, Target::File(&entry)))
            .unwrap();
        t.post().unwrap();
        assert!(wait(&t).outcome.is_success());
        t.release().unwrap();
        let mut got = vec![0u8; 300_007];
        // SAFETY: the transfer retired.
        unsafe { back.read(0, &mut got) };
        assert_eq!(&got[7..], &src[..], "{dir}");
        assert!(got[..7].iter().all(|b| *b == 0));
        e.deregister(id).unwrap();
        e.deregister(bid).unwrap();
        drop((mem, back));
        assert!(e.wait_idle(Duration::from_secs(5)));
        assert_eq!(e.stats(), base, "{dir}: charges back to baseline");
    }
}

#[test]
fn file_route_read_past_eof_is_a_short_completion_with_the_exact_prefix() {
    let e = engine();
    let f = temp("/tmp", "route-eof", &pattern(100_000, 8));
    let entry = Arc::new(Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap());
    let mem = e.allocate_host_memory(1 << 20).unwrap();
    let id =
        e.register_memory_ranges(vec![MemoryRange::host(&mem, 0, 1 << 20, Permission::LocalOnly).unwrap()]).unwrap()[0];
    // SAFETY: nothing else uses the memory now.
    unsafe { mem.write(0, &vec![0xCCu8; 1 << 20]) };
    let t = e
        .prepare(&TransferSpec::new(Op::Read, &[Desc::new(id, 0, 262_144)], &[fext(0, 262_144)], Target::File(&entry)))
        .unwrap();
    t.post().unwrap();
    let r = wait(&t);
    assert_eq!(r.outcome.code, OutcomeCode::ShortCompletion);
    assert_eq!(r.outcome.transferred_prefix, 100_000);
    let mut got = vec![0u8; 262_144];
    // SAFETY: retired.
    unsafe { mem.read(0, &mut got) };
    assert_eq!(&got[..100_000], &pattern(100_000, 8)[..]);
    assert!(got[100_000..].iter().all(|b| *b == 0xCC), "nothing past the end of the file was written");
    // A WRITE into a read-only Entry, and a notification, fail at prepare.
    let err = e.prepare(&TransferSpec::new(Op::Write, &[Desc::new(id, 0, 16)], &[fext(0, 16)], Target::File(&entry)));
    assert!(matches!(err, Err(orbite_core::Error::File(FileError::ModeMismatch(_)))));
    let (l16, r16) = ([Desc::new(id, 0, 16)], [fext(0, 16)]);
    let mut s = TransferSpec::new(Op::Read, &l16, &r16, Target::File(&entry));
    s.notification = Some(b"x");
    assert!(matches!(e.prepare(&s), Err(orbite_core::Error::File(FileError::Unsupported(_)))));
    t.release().unwrap();
    e.deregister(id).unwrap();
}

#[test]
fn closing_a_file_during_a_transfer_drains_admitted_io_and_fences_the_rest() {
    let e = engine();
    let base = e.stats();
    let f = temp("/dev/shm", "route-close", &pattern(1 << 20, 4));
    let entry = Arc::new(Entry::open(&f.0, FileMode::ReadWrite, OpenFlags::default()).unwrap());
    let mem = e.allocate_host_memory(1 << 20).unwrap();
    let id =
        e.register_memory_ranges(vec![MemoryRange::host(&mem, 0, 1 << 20, Permission::LocalOnly).unwrap()]).unwrap()[0];
    // 16 tasks of 64 KiB; the first is held before it touches the file.
    let t = e
        .prepare(&TransferSpec::new(Op::Read, &[Desc::new(id, 0, 1 << 20)], &[fext(0, 1 << 20)], Target::File(&entry)))
        .unwrap();
    let later =
        e.prepare(&TransferSpec::new(Op::Read, &[Desc::new(id, 0, 16)], &[fext(0, 16)], Target::File(&entry))).unwrap();
    e.fault_hooks().hold_all(true);
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, Duration::from_secs(10)));
    entry.close(Duration::from_secs(10)).unwrap(); // nothing admitted in the file yet
    assert!(matches!(later.post(), Err(orbite_core::Error::File(FileError::Closed))), "prepared before, posted after");
    drop(later);
    let t = match t.release() {
        Err(refused) => refused.transfer, // still active: release refused
        Ok(()) => panic!("released while active"),
    };
    e.fault_hooks().hold_all(false);
    e.fault_hooks().release_all();
    let r = wait(&t);
    // Every task that reached the closed file failed before any I/O.
    assert_eq!(r.outcome.code, OutcomeCode::Failed);
    assert_eq!(r.outcome.transferred_bytes, 0);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::None);
    assert!(t.post().is_err(), "no repost after a failure");
    let again = e.prepare(&TransferSpec::new(Op::Read, &[Desc::new(id, 0, 16)], &[fext(0, 16)], Target::File(&entry)));
    assert!(matches!(again, Err(orbite_core::Error::File(FileError::Closed))), "no new work on a closed file");
    t.release().unwrap();
    e.deregister(id).unwrap();
    drop(mem);
    assert!(e.wait_idle(Duration::from_secs(5)));
    assert_eq!(e.stats(), base);
}
