//! O_DIRECT, O_SYNC and O_DSYNC files: aligned spans straight to the
//! device (no bounce buffer taken), unaligned memory and unaligned file
//! extents through the bounce pool with read-modify-write at a WRITE's
//! edges, exact sizes at the end of the file, concurrent edge writes to
//! one block without lost updates, the pool's limit, the flags an adopted
//! descriptor carries, and the engine's charges back to baseline at close.

use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use orbite_core::file::{BouncePool, Entry, FileError, FileIo, FileMode, FileOp, FileSpan, OpenFlags};
use orbite_core::{
    Desc, MemoryRange, Op, OutcomeCode, Permission, RegistrationId, Target, TransferEngine, TransferSpec,
};

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp(dir: &str, name: &str, bytes: &[u8]) -> TempFile {
    let p = PathBuf::from(dir).join(format!("orbite-direct-test-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    TempFile(p)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Page-aligned memory.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: nonzero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: `len` bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        Aligned { ptr, layout }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the whole allocation, owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }

    fn span(&self, off: usize, len: usize, file_offset: u64) -> FileSpan {
        assert!(off + len <= self.layout.size());
        // SAFETY: inside the allocation.
        FileSpan { mem: unsafe { self.ptr.add(off) }, len: len as u64, file_offset }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

const DIRECT: OpenFlags = OpenFlags { direct: true, sync: false, dsync: false };

/// Opens `f` with O_DIRECT, or None (with a SKIP line) where the file
/// system refuses it.
fn open_direct(f: &TempFile, dir: &str) -> Option<Entry> {
    match Entry::open(&f.0, FileMode::ReadWrite, DIRECT) {
        Ok(e) => Some(e),
        Err(FileError::Os { err, .. }) if err.contains("Invalid argument") => {
            println!("SKIP: {dir} refuses O_DIRECT here ({err})");
            None
        }
        Err(e) => panic!("{dir}: {e}"),
    }
}

const DIRS: [&str; 2] = ["/tmp", "/dev/shm"];

#[test]
fn flags_and_alignment_are_reported_for_opened_and_adopted_files() {
    for dir in DIRS {
        let f = temp(dir, "flags", &pattern(8192, 1));
        let Some(e) = open_direct(&f, dir) else { continue };
        assert!(e.flags().direct && !e.flags().sync && !e.flags().dsync, "{dir}");
        let a = e.dio_align().expect("a direct file has an alignment");
        assert!(a.mem.is_power_of_two() && a.offset.is_power_of_two(), "{dir}: {a:?}");
        assert!(a.offset <= 4096 && a.mem <= a.offset.max(4096), "{dir}: {a:?}");
        let facts = e.facts().unwrap();
        let meta = std::fs::metadata(&f.0).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((facts.size, facts.mode, facts.mtime_sec), (8192, meta.mode(), meta.mtime()), "{dir}");
        // A caller's descriptor keeps its own flags.
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
            .open(&f.0)
            .unwrap();
        let adopted = Entry::adopt(fd.as_fd(), FileMode::ReadWrite).unwrap();
        assert_eq!(adopted.flags(), OpenFlags { direct: true, sync: false, dsync: true }, "{dir}");
        assert_eq!(adopted.dio_align(), Some(a));
    }
    let f = temp("/tmp", "sync", &pattern(4096, 1));
    let sync = Entry::open(&f.0, FileMode::ReadWrite, OpenFlags { direct: false, sync: true, dsync: false }).unwrap();
    // O_SYNC includes O_DSYNC's bit.
    assert_eq!(sync.flags(), OpenFlags { direct: false, sync: true, dsync: true });
    assert_eq!(sync.dio_align(), None);
    let dsync = Entry::open(&f.0, FileMode::ReadWrite, OpenFlags { direct: false, sync: false, dsync: true }).unwrap();
    assert_eq!(dsync.flags(), OpenFlags { direct: false, sync: false, dsync: true });
    let plain = Entry::open(&f.0, FileMode::ReadOnly, OpenFlags::default()).unwrap();
    assert_eq!(plain.flags(), OpenFlags::default());
    // Durable writes still move the bytes.
    let io = FileIo::new(4).unwrap();
    let mut src = pattern(4096, 50);
    let s = FileSpan { mem: src.as_mut_ptr(), len: 4096, file_offset: 0 };
    // SAFETY: `src` outlives the call.
    let out = unsafe { io.run(&sync, FileOp::Write, &[s]) }.unwrap();
    assert_eq!((out.prefix, out.error), (4096, None));
    assert_eq!(std::fs::read(&f.0).unwrap(), src);
}

#[test]
fn aligned_spans_go_straight_through_and_take_no_bounce_buffer() {
    let io = FileIo::new(8).unwrap();
    for dir in DIRS {
        let original = pattern(1 << 20, 3);
        let f = temp(dir, "aligned", &original);
        let Some(e) = open_direct(&f, dir) else { continue };
        let mut mem = Aligned::new(1 << 20, 0xEE);
        // READ two aligned extents (adjacent: one vectored operation).
        let spans = [mem.span(4096, 65536, 8192), mem.span(4096 + 65536, 8192, 8192 + 65536)];
        // SAFETY: `mem` outlives the call.
        let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
        assert_eq!((out.prefix, out.error, out.operations), (73728, None, 1), "{dir}");
        let got = mem.bytes();
        assert_eq!(&got[4096..4096 + 73728], &original[8192..8192 + 73728], "{dir}");
        assert!(got[..4096].iter().chain(&got[4096 + 73728..]).all(|b| *b == 0xEE), "{dir}: guards");
        // WRITE an aligned span back elsewhere.
        let mut src = Aligned::new(16384, 0);
        src.bytes().copy_from_slice(&pattern(16384, 77));
        // SAFETY: as above.
        let out = unsafe { io.run(&e, FileOp::Write, &[src.span(0, 16384, 1 << 19)]) }.unwrap();
        assert_eq!((out.prefix, out.error), (16384, None), "{dir}");
        let mut want = original.clone();
        want[1 << 19..(1 << 19) + 16384].copy_from_slice(&pattern(16384, 77));
        assert!(std::fs::read(&f.0).unwrap() == want, "{dir}: file bytes or guards");
        assert_eq!(io.bounce_pool().held_bytes(), 0, "{dir}: aligned I/O takes no bounce buffer");
    }
}

#[test]
fn unaligned_memory_and_extents_bounce_with_exact_bytes_and_guards() {
    let io = FileIo::new(8).unwrap();
    for dir in DIRS {
        let original = pattern(3 << 20, 9);
        let f = temp(dir, "bounce", &original);
        let Some(e) = open_direct(&f, dir) else { continue };
        let mut want = original.clone();
        // READ: memory off by 3, extents unaligned, one larger than a
        // bounce buffer.
        let mut mem = vec![0xEEu8; 3 << 20];
        let base = mem.as_mut_ptr();
        let at = |off: usize, len: u64, file_offset: u64| FileSpan {
            // SAFETY: inside `mem` (checked by the slices below).
            mem: unsafe { base.add(off) },
            len,
            file_offset,
        };
        let spans = [at(3, 4096, 4096), at(5000, 1000, 777), at(10_003, (1 << 20) + 12_345, 100_001)];
        // SAFETY: `mem` outlives the call and is not otherwise used.
        let out = unsafe { io.run(&e, FileOp::Read, &spans) }.unwrap();
        let total = 4096 + 1000 + (1 << 20) + 12_345;
        assert_eq!((out.prefix, out.bytes, out.error), (total, total, None), "{dir}");
        let mut wm = vec![0xEEu8; 3 << 20];
        wm[3..4099].copy_from_slice(&original[4096..8192]);
        wm[5000..6000].copy_from_slice(&original[777..1777]);
        let n = (1 << 20) + 12_345;
        wm[10_003..10_003 + n].copy_from_slice(&original[100_001..100_001 + n]);
        assert!(mem == wm, "{dir}: bytes or guards of the read differ");
        assert!(io.bounce_pool().held_bytes() > 0, "{dir}: the read bounced");
        // WRITE: both edges inside blocks, one span inside a single
        // block, one aligned in the file but not in memory.
        let src = pattern(1 << 20, 123);
        let sp = src.as_ptr() as *mut u8;
        let w = |off: usize, len: u64, file_offset: u64| FileSpan {
            // SAFETY: inside `src`.
            mem: unsafe { sp.add(off) },
            len,
            file_offset,
        };
        let spans = [w(1, 10_000, 5), w(20_000, 100, 40_000), w(30_001, 8192, 1 << 20), w(50_000, 600_000, 2_000_003)];
        // SAFETY: `src` outlives the call; a WRITE only reads it.
        let out = unsafe { io.run(&e, FileOp::Write, &spans) }.unwrap();
        assert_eq!((out.prefix, out.error), (10_000 + 100 + 8192 + 600_000, None), "{dir}");
        want[5..10_005].copy_from_slice(&src[1..10_001]);
        want[40_000..40_100].copy_from_slice(&src[20_000..20_100]);
        want[1 << 20..(1 << 20) + 8192].copy_from_slice(&src[30_001..38_193]);
        want[2_000_003..2_600_003].copy_from_slice(&src[50_000..650_000]);
        let now = std::fs::read(&f.0).unwrap();
        assert_eq!(now.len(), want.len(), "{dir}: the size did not change");
        assert!(now == want, "{dir}: written bytes or the bytes around them differ");
        io.bounce_pool().clear();
        assert_eq!(io.bounce_pool().held_bytes(), 0, "{dir}: the pool gives its buffers back");
    }
}

#[test]
fn unaligned_writes_at_the_end_keep_the_exact_size_and_reads_stop_at_eof() {
    let io = FileIo::new(4).unwrap();
    for dir in DIRS {
        let f = temp(dir, "eof", &pattern(10_000, 4));
        let Some(e) = open_direct(&f, dir) else { continue };
        let src = pattern(20_000, 200);
        let s = |len: u64, file_offset: u64| FileSpan { mem: src.as_ptr() as *mut u8, len, file_offset };
        // Inside the last block, ending before the end: size unchanged.
        // SAFETY (each call): `src` outlives it; a WRITE only reads.
        let out = unsafe { io.run(&e, FileOp::Write, &[s(100, 9000)]) }.unwrap();
        assert_eq!(out.error, None);
        assert_eq!(std::fs::metadata(&f.0).unwrap().len(), 10_000, "{dir}");
        // Across the end: the file grows to exactly the span's end.
        let out = unsafe { io.run(&e, FileOp::Write, &[s(3000, 9500)]) }.unwrap();
        assert_eq!(out.error, None);
        assert_eq!(std::fs::metadata(&f.0).unwrap().len(), 12_500, "{dir}");
        // Past the end with a gap: zeros in between, exact size.
        let out = unsafe { io.run(&e, FileOp::Write, &[s(10, 20_001)]) }.unwrap();
        assert_eq!(out.error, None);
        let now = std::fs::read(&f.0).unwrap();
        assert_eq!(now.len(), 20_011, "{dir}");
        let mut want = pattern(10_000, 4);
        want[9000..9100].copy_from_slice(&src[..100]);
        want.truncate(9500);
        want.extend_from_slice(&src[..3000]);
        want.resize(20_001, 0);
        want.extend_from_slice(&src[..10]);
        assert!(now == want, "{dir}: bytes around the end");
        // A READ across the end lands exactly what is there.
        let mut mem = vec![0xCCu8; 8192];
        let span = FileSpan { mem: mem.as_mut_ptr().wrapping_add(1), len: 5000, file_offset: 17_000 };
        let out = unsafe { io.run(&e, FileOp::Read, &[span]) }.unwrap();
        assert_eq!((out.prefix, out.bytes, out.error), (3011, 3011, None), "{dir}");
        assert_eq!(&mem[1..3012], &want[17_000..]);
        assert!(mem[3012..].iter().all(|b| *b == 0xCC) && mem[0] == 0xCC, "{dir}: nothing past the end");
    }
}

#[test]
fn concurrent_edge_writes_to_one_block_lose_no_update() {
    for dir in DIRS {
        let f = temp(dir, "race", &vec![0u8; 8192]);
        let Some(e) = open_direct(&f, dir) else { continue };
        let e = Arc::new(e);
        // Eight threads each own 100 bytes of the same 4 KiB block and
        // rewrite them again and again with their own byte.
        let threads: Vec<_> = (0..8u8)
            .map(|k| {
                let e = e.clone();
                std::thread::spawn(move || {
                    let io = FileIo::new(2).unwrap();
                    for round in 0..50u8 {
                        let src = [k * 16 + (round % 16); 100];
                        let s = FileSpan { mem: src.as_ptr() as *mut u8, len: 100, file_offset: 1000 + k as u64 * 300 };
                        // SAFETY: `src` outlives the call.
                        let out = unsafe { io.run(&e, FileOp::Write, &[s]) }.unwrap();
                        assert_eq!(out.error, None);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let now = std::fs::read(&f.0).unwrap();
        for k in 0..8u8 {
            let at = 1000 + k as usize * 300;
            assert!(
                now[at..at + 100].iter().all(|b| *b == k * 16 + 49 % 16),
                "{dir}: thread {k}'s last write was lost"
            );
            assert!(now[at + 100..at + 300].iter().all(|b| *b == 0), "{dir}: bytes between writes");
        }
    }
}

#[test]
fn a_full_bounce_pool_fails_the_span_with_a_typed_error_and_touches_nothing() {
    let io = FileIo::new(2).unwrap();
    let f = temp("/tmp", "pool", &pattern(8192, 6));
    let Some(e) = open_direct(&f, "/tmp") else { return };
    let tiny = BouncePool::new(4096); // less than one buffer
    let mut src = pattern(100, 1);
    let s = FileSpan { mem: src.as_mut_ptr(), len: 100, file_offset: 10 };
    // SAFETY: `src` outlives the call.
    let out = unsafe { io.run_with(&e, FileOp::Write, &[s], &tiny) }.unwrap();
    assert_eq!(out.prefix, 0);
    assert!(matches!(out.error, Some(FileError::NoBounce { limit: 4096, .. })), "{:?}", out.error);
    assert_eq!(tiny.held_bytes(), 0, "nothing stays charged");
    assert_eq!(std::fs::read(&f.0).unwrap(), pattern(8192, 6), "nothing was written");
}

#[test]
fn engine_moves_direct_files_and_gives_bounce_buffers_back_at_close() {
    let e = TransferEngine::from_json(r#"{"local_route_workers": 2, "task_bytes": 65536}"#).unwrap();
    let base = e.stats();
    let f = temp("/tmp", "engine", &vec![0x5Au8; 1 << 20]);
    let Some(entry) = open_direct(&f, "/tmp") else { return };
    let entry = Arc::new(entry);
    let mem = e.allocate_host_memory(1 << 20).unwrap();
    let id =
        e.register_memory_ranges(vec![MemoryRange::host(&mem, 0, 1 << 20, Permission::LocalOnly).unwrap()]).unwrap()[0];
    let src = pattern(400_000, 42);
    // SAFETY: nothing else uses the memory now.
    unsafe { mem.write(0, &src) };
    let fext = |offset: u64, len: u64| Desc::new(RegistrationId::from_raw(0), offset, len);
    // Aligned (memory offset 0, file 4096) and unaligned (memory offset
    // 200 001, file 700 003) in one transfer.
    let local = [Desc::new(id, 0, 196_608), Desc::new(id, 200_001, 150_000)];
    let remote = [fext(4096, 196_608), fext(700_003, 150_000)];
    let t = e.prepare(&TransferSpec::new(Op::Write, &local, &remote, Target::File(&entry))).unwrap();
    t.post().unwrap();
    let r = t.wait(Duration::from_secs(20)).result().expect("retired");
    assert_eq!((r.outcome.code, r.outcome.transferred_prefix), (OutcomeCode::Success, 346_608));
    t.release().unwrap();
    let mut want = vec![0x5Au8; 1 << 20];
    want[4096..4096 + 196_608].copy_from_slice(&src[..196_608]);
    want[700_003..850_003].copy_from_slice(&src[200_001..350_001]);
    assert!(std::fs::read(&f.0).unwrap() == want, "file bytes or guards differ");
    // READ both back into zeroed memory.
    // SAFETY: the transfer retired.
    unsafe { mem.write(0, &vec![0u8; 1 << 20]) };
    let t = e.prepare(&TransferSpec::new(Op::Read, &local, &remote, Target::File(&entry))).unwrap();
    t.post().unwrap();
    assert!(t.wait(Duration::from_secs(20)).result().expect("retired").outcome.is_success());
    t.release().unwrap();
    let mut got = vec![0u8; 400_000];
    // SAFETY: retired.
    unsafe { mem.read(0, &mut got) };
    assert_eq!(&got[..196_608], &src[..196_608]);
    assert!(got[196_608..200_001].iter().all(|b| *b == 0), "guard");
    assert_eq!(&got[200_001..350_001], &src[200_001..350_001]);
    let s = e.stats();
    assert!(s.staging_buffers >= 1 && s.staging_bytes <= e.config().max_staging_bytes, "{s:?}");
    e.deregister(id).unwrap();
    drop(mem);
    assert!(e.wait_idle(Duration::from_secs(5)));
    e.close_with_timeout(Duration::from_secs(5));
    let after = e.stats();
    assert_eq!((after.staging_buffers, after.staging_bytes), (base.staging_buffers, base.staging_bytes));
}

#[test]
fn long_direct_spans_become_several_operations_in_flight() {
    let io = FileIo::new(8).unwrap();
    for dir in DIRS {
        let n = 3 * (1 << 20) + 8192;
        let f = temp(dir, "long", &vec![0u8; n + 8192]);
        let Some(e) = open_direct(&f, dir) else { continue };
        let mut src = Aligned::new(n, 0);
        src.bytes().copy_from_slice(&pattern(n, 17));
        // SAFETY: `src` outlives the call.
        let out = unsafe { io.run(&e, FileOp::Write, &[src.span(0, n, 4096)]) }.unwrap();
        let ops = (n as u64).div_ceil(orbite_core::file::DIRECT_OP_BYTES);
        assert_eq!((out.prefix, out.error, out.operations), (n as u64, None, ops), "{dir}");
        let now = std::fs::read(&f.0).unwrap();
        assert!(now[4096..4096 + n] == pattern(n, 17)[..], "{dir}: bytes");
        assert!(now[..4096].iter().chain(&now[4096 + n..]).all(|b| *b == 0), "{dir}: guards");
        let mut back = Aligned::new(n, 0xEE);
        // SAFETY: as above.
        let out = unsafe { io.run(&e, FileOp::Read, &[back.span(0, n, 4096)]) }.unwrap();
        assert_eq!((out.prefix, out.operations), (n as u64, ops), "{dir}");
        assert!(back.bytes() == &pattern(n, 17)[..], "{dir}: read back");
    }
}
