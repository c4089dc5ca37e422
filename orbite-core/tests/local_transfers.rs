//! Byte-exact local (self-connection) transfers with guard bytes.

mod common;

use common::*;
use orbite_core::*;

fn run_fragmented(config: &str, seed: u64, total: u64, max_frag: u64, op: Op) {
    let e = engine(config);
    let base = e.stats();
    let region_len = (total * 2 + (1 << 20)) as usize;
    let a = region(&e, region_len, Permission::RemoteReadWrite);
    let b = region(&e, region_len, Permission::RemoteReadWrite);
    fill(&a.mem, seed);
    fill(&b.mem, seed ^ 0xFFFF);
    let mut rng = Rng(seed);
    let la = layout(&mut rng, total, max_frag, region_len as u64);
    let lb = layout(&mut rng, total, max_frag, region_len as u64);
    let (before_a, before_b) = (snapshot(&a.mem), snapshot(&b.mem));
    let (local, remote) = (descs(a.id, &la), descs(b.id, &lb));
    let t = e.prepare(&spec(op, &local, &remote)).unwrap();
    t.post().unwrap();
    let r = wait_retired(&t);
    assert_eq!(r.outcome.code, OutcomeCode::Success);
    assert_eq!((r.outcome.transferred_prefix, r.outcome.total_bytes), (total, total));
    assert_eq!(r.outcome.remote_effect, RemoteEffect::Known);
    match op {
        Op::Write => {
            assert_eq!(
                snapshot(&b.mem),
                expected(&before_a, &la, &before_b, &lb),
                "destination bytes or guards differ"
            );
            assert_eq!(snapshot(&a.mem), before_a, "source changed");
        }
        Op::Read => {
            assert_eq!(
                snapshot(&a.mem),
                expected(&before_b, &lb, &before_a, &la),
                "destination bytes or guards differ"
            );
            assert_eq!(snapshot(&b.mem), before_b, "source changed");
        }
    }
    t.release().unwrap();
    e.deregister(a.id).unwrap();
    e.deregister(b.id).unwrap();
    assert_idle(&e);
    drop((a, b));
    assert_eq!(e.stats(), base, "charges back to baseline");
}

#[test]
fn fragmented_write_small_fragments_one_worker() {
    run_fragmented("{}", 1, 200_000, 97, Op::Write);
}

#[test]
fn fragmented_read_small_fragments() {
    run_fragmented("{}", 2, 300_000, 1000, Op::Read);
}

#[test]
fn fragmented_write_up_to_several_mib_small_tasks_two_workers() {
    run_fragmented(r#"{"task_bytes": 65536, "local_route_workers": 2}"#, 3, 12 << 20, 3 << 20, Op::Write);
}

#[test]
fn fragmented_read_up_to_several_mib_tiny_budget() {
    // Budget of two 64 KiB tasks: most of the work waits for admission.
    run_fragmented(
        r#"{"task_bytes": 65536, "max_bytes_in_flight": 131072, "max_tasks_in_flight": 2, "local_route_workers": 2}"#,
        4,
        6 << 20,
        2 << 20,
        Op::Read,
    );
}

#[test]
fn many_seeds_mixed_sizes() {
    for seed in 10..40 {
        let op = if seed % 2 == 0 { Op::Write } else { Op::Read };
        run_fragmented(r#"{"task_bytes": 8192}"#, seed, 40_000 + seed * 997, 1 + seed * 311, op);
    }
}

#[test]
fn single_byte_at_odd_offsets() {
    let e = engine("{}");
    let a = region(&e, 4096, Permission::RemoteReadWrite);
    let b = region(&e, 4096, Permission::RemoteReadWrite);
    fill(&a.mem, 7);
    let before_b = snapshot(&b.mem);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 4095, 1)], &[Desc::new(b.id, 1, 1)])).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    let after = snapshot(&b.mem);
    assert_eq!(after[1], snapshot(&a.mem)[4095]);
    assert_eq!(after[0], before_b[0]);
    assert_eq!(&after[2..], &before_b[2..]);
}

#[test]
fn overlapping_aliases_of_one_memory_copy_through_either_id() {
    let e = engine("{}");
    let mem = e.allocate_host_memory(1 << 16).unwrap();
    fill(&mem, 9);
    let ids = e
        .register_memory_ranges(vec![
            MemoryRange::host(&mem, 0, 1 << 16, Permission::RemoteReadWrite).unwrap(),
            MemoryRange::host(&mem, 4096, 8192, Permission::RemoteReadWrite).unwrap(),
        ])
        .unwrap();
    let before = snapshot(&mem);
    // Copy bytes 0..100 of the big alias to offset 10 of the small alias
    // (= byte 4106 of the memory).
    let t = e.prepare(&spec(Op::Write, &[Desc::new(ids[0], 0, 100)], &[Desc::new(ids[1], 10, 100)])).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    let mut want = before.clone();
    want.copy_within(0..100, 4106);
    assert_eq!(snapshot(&mem), want);
}

#[test]
fn borrowed_caller_memory_round_trip() {
    let e = engine("{}");
    let mut src: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0xEEu8; 10_016];
    // SAFETY: both vectors outlive the transfer: it is waited for and
    // released, and the registrations removed, before they are dropped.
    let ids = e
        .register_memory_ranges(unsafe {
            vec![
                MemoryRange::borrowed(src.as_mut_ptr(), src.len(), Permission::LocalOnly),
                MemoryRange::borrowed(dst.as_mut_ptr(), dst.len(), Permission::RemoteReadWrite),
            ]
        })
        .unwrap();
    let t = e.prepare(&spec(Op::Write, &[Desc::new(ids[0], 0, 10_000)], &[Desc::new(ids[1], 8, 10_000)])).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    t.release().unwrap();
    e.deregister(ids[0]).unwrap();
    e.deregister(ids[1]).unwrap();
    assert_eq!(&dst[8..10_008], &src[..]);
    assert!(dst[..8].iter().chain(&dst[10_008..]).all(|b| *b == 0xEE), "guard bytes changed");
}

#[test]
fn repost_of_drained_success_moves_fresh_bytes() {
    let e = engine("{}");
    let a = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let b = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let (l, r) = ([Desc::new(a.id, 0, 1 << 20)], [Desc::new(b.id, 0, 1 << 20)]);
    let t = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
    for round in 0..3u64 {
        fill(&a.mem, 100 + round);
        t.post().unwrap();
        let res = wait_retired(&t);
        assert!(res.outcome.is_success());
        assert_eq!(res.receipt.execution, round + 1);
        assert_eq!(snapshot(&b.mem), snapshot(&a.mem));
        assert_eq!(e.stats().executions, 0, "fresh accounting per execution");
    }
}

#[test]
fn small_lone_transfer_is_copied_inside_post() {
    // Copied on the posting thread, the execution has retired by the time
    // post returns; handed to a worker, it almost never would have.
    let e = engine(r#"{"local_route_workers": 1, "inline_max_bytes": 4096}"#);
    let base = e.stats();
    let a = region(&e, 1 << 16, Permission::RemoteReadWrite);
    let b = region(&e, 1 << 16, Permission::RemoteReadWrite);
    fill(&a.mem, 11);
    for (off, len) in [(0u64, 4096u64), (8191, 1), (12289, 4000)] {
        let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, off, len)], &[Desc::new(b.id, off, len)])).unwrap();
        let before = snapshot(&b.mem);
        t.post().unwrap();
        let TransferStatus::Retired(r) = t.status() else { panic!("not retired when post returned") };
        assert!(r.outcome.is_success());
        assert_eq!(snapshot(&b.mem), expected(&snapshot(&a.mem), &[(off, len)], &before, &[(off, len)]));
        t.release().unwrap();
    }
    e.deregister(a.id).unwrap();
    e.deregister(b.id).unwrap();
    assert_idle(&e);
    drop((a, b));
    assert_eq!(e.stats(), base);
}

/// A caller that posts, polls or waits on its transfer may copy the
/// transfer's tasks queued next on its own thread: bytes, statuses and
/// charges are as if the workers alone had moved it.
#[test]
fn a_caller_that_polls_moves_its_own_transfer() {
    let e = engine(r#"{"local_route_workers": 1, "spin_us": 0}"#);
    let base = e.stats();
    let len = 64 << 20;
    let a = region(&e, len, Permission::RemoteReadWrite);
    let b = region(&e, len, Permission::RemoteReadWrite);
    fill(&a.mem, 21);
    let helped = e.route_helped();
    for (round, op) in [Op::Write, Op::Read, Op::Write].into_iter().enumerate() {
        fill(&b.mem, 100 + round as u64);
        let before = (snapshot(&a.mem), snapshot(&b.mem));
        let l = [Desc::new(a.id, 0, len as u64)];
        let r = [Desc::new(b.id, 0, len as u64)];
        let t = e.prepare(&spec(op, &l, &r)).unwrap();
        assert_eq!(t.shape().1, 64, "64 tasks of 1 MiB");
        t.post().unwrap();
        let status = if round == 2 {
            t.wait(WAIT) // a waiting caller helps too
        } else {
            loop {
                match t.check() {
                    TransferStatus::InProgress { .. } => {}
                    s => break s,
                }
            }
        };
        let TransferStatus::Retired(res) = status else { panic!("{status:?}") };
        assert!(res.outcome.is_success());
        let (src, dst) = if op == Op::Write { (&before.0, snapshot(&b.mem)) } else { (&before.1, snapshot(&a.mem)) };
        assert_eq!(&dst, src, "{op:?}: every byte");
        t.release().unwrap();
    }
    // Which thread copied what depends on the scheduler (the unit test of
    // `LocalRoute::help` pins it down); the post's own help alone makes it
    // almost always at least one.
    eprintln!("tasks the caller copied: {} of 192", e.route_helped() - helped);
    e.deregister(a.id).unwrap();
    e.deregister(b.id).unwrap();
    assert_idle(&e);
    drop((a, b));
    assert_eq!(e.stats(), base);
}
