mod common;
use common::*;
use orbite_core::*;
use std::time::Duration;

#[test]
fn smoke_two_engines_in_process() {
    let t = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let i = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let tr = region(&t, 1 << 22, Permission::RemoteReadWrite);
    let ir = region(&i, 1 << 22, Permission::RemoteReadWrite);
    fill(&ir.mem, 5);
    let seg = i.open_segment(&t.endpoint().unwrap(), Some(t.source_epoch()), Duration::from_secs(5)).unwrap();
    let l = [Desc::new(ir.id, 0, 1 << 22)];
    let r = [Desc::new(tr.id, 0, 1 << 22)];
    let mut s = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
    s.notification = Some(b"hello\0\xff");
    let x = i.prepare(&s).unwrap();
    x.post().unwrap();
    let res = wait_retired(&x);
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(snapshot(&tr.mem), snapshot(&ir.mem));
    let n = t.take_notifications();
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].payload, b"hello\0\xff");
    // read back
    fill(&ir.mem, 9);
    let y = i.prepare(&TransferSpec::new(Op::Read, &l, &r, Target::Peer(&seg))).unwrap();
    y.post().unwrap();
    assert!(wait_retired(&y).outcome.is_success());
    assert_eq!(snapshot(&tr.mem), snapshot(&ir.mem));
}
