//! Same-host routes: shm (one-sided copies into a peer's shared
//! allocation mapped here) and cma (cross-memory copies into a peer's
//! ordinary memory), with an explicit route policy.

mod common;

use common::*;
use orbite_core::*;

fn listening() -> TransferEngine {
    engine(r#"{"listen": "127.0.0.1:0"}"#)
}

#[test]
fn smoke_routes_in_process() {
    let t = listening();
    let shm = t.allocate_shm_memory(1 << 20).unwrap();
    let shm_id = t
        .register_memory_ranges(vec![MemoryRange::host(&shm, 0, 1 << 20, Permission::RemoteReadWrite).unwrap()])
        .unwrap()[0];
    let plain = region(&t, 1 << 20, Permission::RemoteReadWrite);
    let i = listening();
    let src = region(&i, 1 << 20, Permission::RemoteReadWrite);
    fill(&src.mem, 3);
    let seg = i.open_segment(&t.endpoint().unwrap(), Some(t.source_epoch()), WAIT).unwrap();
    let l = [Desc::new(src.id, 0, 1 << 20)];
    for (remote, want) in [(shm_id, Route::Shm), (plain.id, Route::Cma)] {
        let r = [Desc::new(remote, 0, 1 << 20)];
        let x = i.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(x.route().route, want, "{}", x.route().reason);
        x.post().unwrap();
        assert!(wait_retired(&x).outcome.is_success());
    }
    assert_eq!(snapshot(&shm), snapshot(&src.mem));
    assert_eq!(snapshot(&plain.mem), snapshot(&src.mem));
}
