//! A raw socket sends bad frames to a listening engine: the engine answers
//! with typed errors or drops that connection, keeps serving others, and
//! never touches a byte outside registered ranges.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use orbite_core::wire::{self, Kind, RemoteDesc, RemoteStatus};
use orbite_core::*;

struct Listener {
    e: TransferEngine,
    rw: Region,
    ro: Region,
    guard_before: Vec<u8>,
}

fn target() -> Listener {
    let e = engine(r#"{"listen": "127.0.0.1:0", "max_frame_body": 131072, "max_notification_bytes": 1000}"#);
    let rw = region(&e, 65536, Permission::RemoteReadWrite);
    let ro = region(&e, 4096, Permission::RemoteRead);
    fill(&rw.mem, 1);
    fill(&ro.mem, 2);
    let guard_before = snapshot(&ro.mem);
    Listener { e, rw, ro, guard_before }
}

fn connect(t: &Listener) -> TcpStream {
    let s = TcpStream::connect(t.e.endpoint().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn frame(kind: Kind, body: &[u8], data: &[u8], request: u64) -> Vec<u8> {
    let mut f = wire::encode_header(&wire::header(kind, body.len(), data.len() as u64, request)).to_vec();
    f.extend_from_slice(body);
    f.extend_from_slice(data);
    f
}

fn request(epoch: u64, descs: &[RemoteDesc]) -> Vec<u8> {
    let mut b = Vec::new();
    wire::encode_request(&mut b, epoch, descs.iter().copied());
    b
}

/// Reads one reply: its header and body.
fn reply(s: &mut TcpStream) -> (wire::Header, Vec<u8>) {
    read_frame(s)
}

fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

fn describe_works(s: &mut TcpStream) {
    let mut b = Vec::new();
    wire::encode_describe(&mut b, 1, 0);
    s.write_all(&frame(Kind::Describe, &b, &[], 77)).unwrap();
    let (h, _) = reply(s);
    assert_eq!((h.kind, h.request), (Kind::DescribeReply, 77), "connection must stay usable");
}

fn refused(s: &mut TcpStream, f: &[u8]) -> RemoteStatus {
    s.write_all(f).unwrap();
    let (h, body) = reply(s);
    assert_eq!(h.kind, Kind::Error);
    common::refusal(&body).0
}

#[test]
fn malformed_frames_close_only_their_connection() {
    let t = target();
    let mut bystander = connect(&t);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("bad magic", {
            let mut f = frame(Kind::Describe, &[0u8; 16], &[], 1);
            f[0] = b'X';
            f
        }),
        ("unknown major", {
            let mut f = frame(Kind::Describe, &[0u8; 16], &[], 1);
            f[4] = 9;
            f
        }),
        ("unknown kind", {
            let mut f = frame(Kind::Describe, &[0u8; 16], &[], 1);
            f[6] = 250;
            f
        }),
        ("huge body length", wire::encode_header(&wire::header(Kind::Write, u32::MAX as usize, 0, 1)).to_vec()),
        ("huge data length", wire::encode_header(&wire::header(Kind::Write, 40, u32::MAX as u64, 1)).to_vec()),
        ("truncated request body", frame(Kind::Read, &[1, 2, 3], &[], 1)),
        ("write payload length disagrees with descriptors", {
            let b = request(t.e.source_epoch(), &[RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len: 10 }]);
            frame(Kind::Write, &b, &[0u8; 4], 1)
        }),
        ("a reply kind sent as a request", frame(Kind::WriteAck, &[], &[], 1)),
    ];
    for (what, f) in cases {
        let mut s = connect(&t);
        s.write_all(&f).unwrap();
        assert!(closed(&mut s), "{what}: connection should be closed");
    }
    describe_works(&mut bystander);
    assert_eq!(snapshot(&t.ro.mem), t.guard_before);
}

#[test]
fn invalid_requests_get_typed_errors_and_the_connection_stays_usable() {
    let t = target();
    let before_rw = snapshot(&t.rw.mem);
    let epoch = t.e.source_epoch();
    let rw = t.rw.id.to_raw();
    let ro = t.ro.id.to_raw();
    let mut s = connect(&t);
    let d = |registration, offset, len| RemoteDesc { registration, offset, len };
    let payload = vec![0xEEu8; 100];
    type Case<'a> = (&'a str, Kind, Vec<u8>, &'a [u8], RemoteStatus);
    let cases: Vec<Case> = vec![
        ("out of range offset", Kind::Write, request(epoch, &[d(rw, 65500, 100)]), &payload, RemoteStatus::OutOfBounds),
        ("offset overflow", Kind::Read, request(epoch, &[d(rw, u64::MAX, 2)]), &[], RemoteStatus::OutOfBounds),
        (
            "stale generation",
            Kind::Write,
            request(epoch, &[d(rw + (1 << 32), 0, 100)]),
            &payload,
            RemoteStatus::StaleRegistration,
        ),
        ("unknown registration", Kind::Read, request(epoch, &[d(999, 0, 1)]), &[], RemoteStatus::UnknownRegistration),
        (
            "write to a read-only range",
            Kind::Write,
            request(epoch, &[d(ro, 0, 100)]),
            &payload,
            RemoteStatus::PermissionDenied,
        ),
        ("wrong epoch", Kind::Write, request(epoch ^ 1, &[d(rw, 0, 100)]), &payload, RemoteStatus::EpochMismatch),
        ("zero-length descriptor", Kind::Read, request(epoch, &[d(rw, 0, 0)]), &[], RemoteStatus::OutOfBounds),
        (
            "second descriptor bad after a good one",
            Kind::Write,
            request(epoch, &[d(rw, 0, 50), d(rw, 65536, 50)]),
            &payload,
            RemoteStatus::OutOfBounds,
        ),
    ];
    for (what, kind, body, data, want) in cases {
        assert_eq!(refused(&mut s, &frame(kind, &body, data, 5)), want, "{what}");
        describe_works(&mut s);
    }
    // Oversized and stale notifications.
    let mut n = Vec::new();
    let env = |target_epoch, payload: &'static [u8]| wire::NotifyEnvelope {
        sender_endpoint: "127.0.0.1:1",
        sender_epoch: 5,
        target_epoch,
        payload,
    };
    wire::encode_notify(&mut n, &env(epoch ^ 1, b"hi"));
    assert_eq!(refused(&mut s, &frame(Kind::Notify, &n, &[], 6)), RemoteStatus::EpochMismatch);
    static BIG: [u8; 65000] = [1u8; 65000];
    wire::encode_notify(&mut n, &env(epoch, &BIG));
    assert_eq!(refused(&mut s, &frame(Kind::Notify, &n, &[], 7)), RemoteStatus::NotificationTooLarge);
    assert!(t.e.take_notifications().is_empty());
    // Nothing was written anywhere, and no loan is left behind.
    assert_eq!(snapshot(&t.rw.mem), before_rw);
    assert_eq!(snapshot(&t.ro.mem), t.guard_before);
    assert_eq!(t.e.stats().fenced_registrations, 0);
    // A valid write on the same connection still lands, exactly in range.
    let body = request(epoch, &[d(rw, 10, 100)]);
    s.write_all(&frame(Kind::Write, &body, &payload, 8)).unwrap();
    let (h, _) = reply(&mut s);
    assert_eq!((h.kind, h.request), (Kind::WriteAck, 8));
    let after = snapshot(&t.rw.mem);
    assert_eq!(&after[10..110], &payload[..]);
    assert_eq!(&after[..10], &before_rw[..10]);
    assert_eq!(&after[110..], &before_rw[110..]);
}

#[test]
fn stale_sender_epoch_is_refused_by_a_receiver_that_knows_the_sender() {
    let receiver = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let sender = engine(r#"{"listen": "127.0.0.1:0"}"#);
    // The receiver knows the sender (it opened the sender's segment).
    let _known = receiver.open_segment(&sender.endpoint().unwrap(), Some(sender.source_epoch()), WAIT).unwrap();
    let mut s = TcpStream::connect(receiver.endpoint().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let ep = sender.endpoint().unwrap();
    let mut n = Vec::new();
    wire::encode_notify(
        &mut n,
        &wire::NotifyEnvelope {
            sender_endpoint: &ep,
            sender_epoch: sender.source_epoch() ^ 0x10,
            target_epoch: receiver.source_epoch(),
            payload: b"stale",
        },
    );
    assert_eq!(refused(&mut s, &frame(Kind::Notify, &n, &[], 1)), RemoteStatus::EpochMismatch);
    // The real sender's notification is accepted, with its identity.
    let seg = sender.open_segment(&receiver.endpoint().unwrap(), None, WAIT).unwrap();
    sender.notify(&seg, b"fresh").unwrap();
    let got = receiver.take_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].sender_endpoint.as_str(), got[0].sender_epoch), (ep.as_str(), sender.source_epoch()));
}

#[test]
fn failed_notification_fails_the_transfer_without_replaying_the_write() {
    let target = engine(r#"{"listen": "127.0.0.1:0", "notification_queue_bytes": 4}"#);
    let t_reg = region(&target, 65536, Permission::RemoteReadWrite);
    let init = engine("{}");
    let local = region(&init, 65536, Permission::RemoteReadWrite);
    fill(&local.mem, 9);
    let seg = init.open_segment(&target.endpoint().unwrap(), Some(target.source_epoch()), WAIT).unwrap();
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(t_reg.id, 0, 4096)]);
    let mut s = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
    s.notification = Some(b"too long for the queue");
    let t = init.prepare(&s).unwrap();
    t.post().unwrap();
    let res = wait_retired(&t);
    assert_eq!(res.outcome.code, OutcomeCode::NotificationFailed);
    assert_eq!((res.outcome.transferred_prefix, res.outcome.remote_effect), (4096, RemoteEffect::Known));
    assert_eq!(&snapshot(&t_reg.mem)[..4096], &snapshot(&local.mem)[..4096]);
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
    assert!(target.take_notifications().is_empty());
}

#[test]
fn borrow_and_return_frames_are_validated() {
    let t = target();
    let epoch = t.e.source_epoch();
    let d = |registration, len| RemoteDesc { registration, offset: 0, len };
    let mut s = connect(&t);
    let borrow = |id: u64, write: bool, descs: &[RemoteDesc], epoch: u64| {
        let mut b = Vec::new();
        wire::encode_borrow(&mut b, id, epoch, descs.iter().copied());
        let mut f = frame(Kind::Borrow, &b, &[], 3);
        f[7] = if write { wire::BORROW_WRITE } else { 0 };
        f
    };
    // Writing a read-only registration, a stale id, a wrong epoch: refused.
    assert_eq!(refused(&mut s, &borrow(1, true, &[d(t.ro.id.to_raw(), 4096)], epoch)), RemoteStatus::PermissionDenied);
    assert_eq!(
        refused(&mut s, &borrow(2, false, &[d(t.rw.id.to_raw() + (1 << 32), 1)], epoch)),
        RemoteStatus::StaleRegistration
    );
    assert_eq!(refused(&mut s, &borrow(3, false, &[d(t.rw.id.to_raw(), 1)], epoch ^ 1)), RemoteStatus::EpochMismatch);
    assert_eq!(refused(&mut s, &borrow(4, false, &[d(t.rw.id.to_raw(), 65537)], epoch)), RemoteStatus::OutOfBounds);
    // A valid borrow keeps a deregistered registration alive until returned.
    s.write_all(&borrow(5, true, &[d(t.rw.id.to_raw(), 65536)], epoch)).unwrap();
    assert_eq!(reply(&mut s).0.kind, Kind::BorrowAck);
    assert_eq!(refused(&mut s, &borrow(5, false, &[d(t.rw.id.to_raw(), 1)], epoch)), RemoteStatus::Other, "id in use");
    t.e.deregister(t.rw.id).unwrap();
    assert_eq!(t.e.stats().fenced_registrations, 1);
    s.write_all(&frame(Kind::Return, &5u64.to_le_bytes(), &[], 6)).unwrap();
    assert_eq!(reply(&mut s).0.kind, Kind::ReturnAck);
    wait_unfenced(&t.e, "the returned borrow kept its loan");
    // Returning an unknown id is harmless; a malformed return closes.
    s.write_all(&frame(Kind::Return, &99u64.to_le_bytes(), &[], 7)).unwrap();
    assert_eq!(reply(&mut s).0.kind, Kind::ReturnAck);
    s.write_all(&frame(Kind::Return, &[1, 2, 3], &[], 8)).unwrap();
    assert!(closed(&mut s));
}

/// CUDA IPC handles and device borrows go to the local socket only: over
/// TCP both are refused with a typed error, nothing is lent, and the
/// connection stays usable; a malformed request closes only itself.
#[test]
fn ipc_handle_requests_and_device_borrows_are_refused_over_tcp() {
    let t = target();
    let epoch = t.e.source_epoch();
    let mut s = connect(&t);
    let mut b = Vec::new();
    wire::encode_ipc_handles(&mut b, epoch, &[t.rw.id.to_raw(), t.ro.id.to_raw()]);
    assert_eq!(refused(&mut s, &frame(Kind::IpcHandles, &b, &[], 3)), RemoteStatus::PermissionDenied);
    let mut borrow = Vec::new();
    wire::encode_borrow(
        &mut borrow,
        1,
        epoch,
        [RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len: 1 }].into_iter(),
    );
    let mut f = frame(Kind::Borrow, &borrow, &[], 4);
    f[7] = wire::BORROW_DEVICE;
    assert_eq!(refused(&mut s, &f), RemoteStatus::PermissionDenied);
    assert_eq!(t.e.stats().fenced_registrations, 0);
    describe_works(&mut s);
    // Too many ids, and a short body: the connection is closed.
    let mut huge = Vec::new();
    wire::encode_ipc_handles(&mut huge, epoch, &vec![1u64; wire::MAX_IPC_HANDLES + 1]);
    s.write_all(&frame(Kind::IpcHandles, &huge, &[], 5)).unwrap();
    assert!(closed(&mut s));
    let mut s = connect(&t);
    s.write_all(&frame(Kind::IpcHandles, &b[..b.len() - 1], &[], 6)).unwrap();
    assert!(closed(&mut s));
    let mut s = connect(&t);
    describe_works(&mut s);
}

#[test]
fn a_closed_connection_gives_back_its_borrows() {
    let t = target();
    let epoch = t.e.source_epoch();
    let mut s = connect(&t);
    let mut b = Vec::new();
    wire::encode_borrow(
        &mut b,
        1,
        epoch,
        [RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len: 100 }].into_iter(),
    );
    s.write_all(&frame(Kind::Borrow, &b, &[], 1)).unwrap();
    assert_eq!(reply(&mut s).0.kind, Kind::BorrowAck);
    t.e.deregister(t.rw.id).unwrap();
    assert_eq!(t.e.stats().fenced_registrations, 1);
    drop(s); // the borrower goes away without returning
    wait_unfenced(&t.e, "a dead borrower's loans were kept");
}

#[test]
fn a_connection_closed_halfway_through_a_payload_gives_back_its_loans() {
    let t = target();
    let epoch = t.e.source_epoch();
    let mut s = connect(&t);
    let len = 60_000u64;
    let body = request(epoch, &[RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len }]);
    // The header promises `len` payload bytes; a third of them follow.
    let mut f = wire::encode_header(&wire::header(Kind::Write, body.len(), len, 1)).to_vec();
    f.extend_from_slice(&body);
    f.extend_from_slice(&vec![0xAB; (len / 3) as usize]);
    s.write_all(&f).unwrap();
    // Once the sent third has landed, the request was validated and its
    // loan taken: deregistering fences the range, and the landing request
    // keeps it alive.
    wait_landed(&t.rw.mem, (len / 3) as usize);
    t.e.deregister(t.rw.id).unwrap();
    assert_eq!(t.e.stats().fenced_registrations, 1);
    drop(s); // the initiator goes away mid-payload
    wait_unfenced(&t.e, "a half-landed request's loans were kept");
    // Other connections are still served.
    let mut again = connect(&t);
    describe_works(&mut again);
}

fn target_with(json: &str) -> Listener {
    let e = engine(json);
    let rw = region(&e, 65536, Permission::RemoteReadWrite);
    let ro = region(&e, 4096, Permission::RemoteRead);
    fill(&rw.mem, 1);
    fill(&ro.mem, 2);
    let guard_before = snapshot(&ro.mem);
    Listener { e, rw, ro, guard_before }
}

fn borrow_frame(id: u64, epoch: u64, descs: &[RemoteDesc]) -> Vec<u8> {
    let mut b = Vec::new();
    wire::encode_borrow(&mut b, id, epoch, descs.iter().copied());
    frame(Kind::Borrow, &b, &[], id)
}

/// Waits until a WRITE's payload bytes (0xAB) have landed up to `end`, so
/// the server has validated the request and taken its loan. (Waiting on the
/// bytes, not a fixed time: under valgrind the server is slow.)
fn wait_landed(mem: &orbite_core::HostMemory, end: usize) {
    let start = std::time::Instant::now();
    loop {
        let mut tail = [0u8; 8];
        // SAFETY: the server writes these bytes once; a torn read only
        // delays the loop.
        unsafe { mem.read(end - 8, &mut tail) };
        if tail == [0xAB; 8] {
            return;
        }
        assert!(start.elapsed() < WAIT, "the payload's first bytes never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn wait_unfenced(e: &TransferEngine, what: &str) {
    let start = std::time::Instant::now();
    while e.stats().fenced_registrations != 0 {
        assert!(start.elapsed() < WAIT, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Attack: a Return sent on another connection ended a borrow its borrower
/// still held, and a squatter could block a borrower's id. Borrows are
/// now the borrowing connection's own.
#[test]
fn a_return_from_another_connection_does_not_end_a_borrow() {
    let t = target();
    let epoch = t.e.source_epoch();
    let rw = RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len: 100 };
    let ro = RemoteDesc { registration: t.ro.id.to_raw(), offset: 0, len: 100 };
    let (mut owner, mut other) = (connect(&t), connect(&t));
    owner.write_all(&borrow_frame(5, epoch, &[rw])).unwrap();
    assert_eq!(reply(&mut owner).0.kind, Kind::BorrowAck);
    t.e.deregister(t.rw.id).unwrap();
    assert_eq!(t.e.stats().fenced_registrations, 1);
    other.write_all(&frame(Kind::Return, &5u64.to_le_bytes(), &[], 1)).unwrap();
    assert_eq!(reply(&mut other).0.kind, Kind::ReturnAck, "answered like any unknown id");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(t.e.stats().fenced_registrations, 1, "another connection ended the borrow");
    // A squatter's id does not block the borrower's.
    other.write_all(&borrow_frame(7, epoch, &[ro])).unwrap();
    assert_eq!(reply(&mut other).0.kind, Kind::BorrowAck);
    owner.write_all(&borrow_frame(7, epoch, &[ro])).unwrap();
    assert_eq!(reply(&mut owner).0.kind, Kind::BorrowAck, "a squatter blocked the borrower's id");
    owner.write_all(&frame(Kind::Return, &5u64.to_le_bytes(), &[], 2)).unwrap();
    assert_eq!(reply(&mut owner).0.kind, Kind::ReturnAck);
    wait_unfenced(&t.e, "the owner's return did not end its borrow");
    describe_works(&mut other);
}

/// Attack: one Borrow frame naming two registrations 43,690 times cost the
/// target a loan per descriptor, and 65,536 borrows were allowed. A borrow
/// now counts each registration once, and borrows per connection and
/// registrations per borrow are capped; a closed connection gives back all.
#[test]
fn borrows_count_each_registration_once_and_are_capped() {
    let t = target_with(
        r#"{"listen": "127.0.0.1:0", "max_frame_body": 131072, "max_borrows_per_connection": 8,
            "max_registrations_per_borrow": 1}"#,
    );
    let epoch = t.e.source_epoch();
    let rw = RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len: 16 };
    let ro = RemoteDesc { registration: t.ro.id.to_raw(), offset: 0, len: 16 };
    let mut s = connect(&t);
    // 5000 descriptors of two registrations: two registrations, over the cap.
    let alternating: Vec<RemoteDesc> = (0..5000).map(|i| if i % 2 == 0 { rw } else { ro }).collect();
    assert_eq!(refused(&mut s, &borrow_frame(1, epoch, &alternating)), RemoteStatus::ResourceExhausted);
    // 5000 descriptors of one registration: one loan.
    let same = vec![rw; 5000];
    for id in 1..=8 {
        s.write_all(&borrow_frame(id, epoch, &same)).unwrap();
        assert_eq!(reply(&mut s).0.kind, Kind::BorrowAck, "borrow {id}");
    }
    assert_eq!(refused(&mut s, &borrow_frame(9, epoch, &[rw])), RemoteStatus::ResourceExhausted);
    // Another connection has borrows of its own.
    let mut other = connect(&t);
    other.write_all(&borrow_frame(9, epoch, &[rw])).unwrap();
    assert_eq!(reply(&mut other).0.kind, Kind::BorrowAck);
    t.e.deregister(t.rw.id).unwrap();
    drop(s);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(t.e.stats().fenced_registrations, 1, "the other connection's borrow keeps it");
    drop(other);
    wait_unfenced(&t.e, "closed connections kept their borrows");
    let mut again = connect(&t);
    describe_works(&mut again);
}

/// Attack: notifications with empty payloads and 60 KB sender endpoints
/// were never charged, and the queue had no count limit. They are now
/// charged whole, capped in count, and long endpoints are refused.
#[test]
fn notifications_are_charged_whole_and_capped_in_count() {
    let t = target_with(r#"{"listen": "127.0.0.1:0", "max_frame_body": 131072, "notification_queue_len": 100}"#);
    let base = t.e.stats();
    let epoch = t.e.source_epoch();
    let notify = |endpoint: &str, request: u64| {
        let mut b = Vec::new();
        let env =
            wire::NotifyEnvelope { sender_endpoint: endpoint, sender_epoch: 9, target_epoch: epoch, payload: &[] };
        wire::encode_notify(&mut b, &env);
        frame(Kind::Notify, &b, &[], request)
    };
    let mut s = connect(&t);
    let long = "h".repeat(60_000);
    assert_eq!(refused(&mut s, &notify(&long, 1)), RemoteStatus::BadLength);
    let endpoint = "e".repeat(200);
    for i in 0..100 {
        s.write_all(&notify(&endpoint, 10 + i)).unwrap();
        assert_eq!(reply(&mut s).0.kind, Kind::NotifyAck, "notification {i}");
    }
    assert_eq!(t.e.stats().notification_bytes, base.notification_bytes + 100 * (200 + 128));
    assert_eq!(refused(&mut s, &notify(&endpoint, 200)), RemoteStatus::ResourceExhausted, "the 101st");
    let got = t.e.take_notifications();
    assert_eq!(got.len(), 100);
    assert!(got.iter().all(|n| n.sender_endpoint == endpoint && n.payload.is_empty()));
    // Back to baseline, but for the connection still open.
    assert_eq!(t.e.stats(), Stats { connections: base.connections + 1, ..base }, "charges back to baseline");
    describe_works(&mut s);
}

fn wait_closed(s: &mut TcpStream, within: Duration, what: &str) {
    s.set_read_timeout(Some(within)).unwrap();
    let start = std::time::Instant::now();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("{what}: still open after {:?}", start.elapsed())
            }
            Err(_) => return, // reset: closed
        }
    }
}

const BOUNDED: &str = r#"{"listen": "127.0.0.1:0", "max_frame_body": 131072, "server_frame_timeout_ms": 300}"#;

/// Attack: a WRITE stalled after 100 payload bytes kept a deregistered
/// range alive for over 25 s. The frame deadline cuts it and its loans end.
#[test]
fn a_stalled_write_is_cut_at_the_frame_deadline_and_gives_back_its_loans() {
    let t = target_with(BOUNDED);
    let mut bystander = connect(&t);
    describe_works(&mut bystander);
    let mut s = connect(&t);
    let len = 60_000u64;
    let body = request(t.e.source_epoch(), &[RemoteDesc { registration: t.rw.id.to_raw(), offset: 0, len }]);
    let mut f = wire::encode_header(&wire::header(Kind::Write, body.len(), len, 1)).to_vec();
    f.extend_from_slice(&body);
    f.extend_from_slice(&[0xAB; 100]);
    s.write_all(&f).unwrap();
    wait_landed(&t.rw.mem, 100);
    t.e.deregister(t.rw.id).unwrap();
    assert_eq!(t.e.stats().fenced_registrations, 1, "the landing request holds its loan");
    let start = std::time::Instant::now();
    wait_closed(&mut s, Duration::from_secs(5), "a stalled WRITE");
    wait_unfenced(&t.e, "the cut request kept its loan");
    assert!(start.elapsed() < Duration::from_secs(3), "cut after {:?}", start.elapsed());
    // The bystander, idle between frames meanwhile, is still served.
    describe_works(&mut bystander);
}

/// A frame sent a byte at a time is closed at the frame deadline; a
/// connection idle between frames, or idle since it connected (a link's
/// data connections stay silent until they have work), is kept.
#[test]
fn trickling_connections_are_closed_and_idle_ones_kept() {
    let t = target_with(BOUNDED);
    let mut idle = connect(&t);
    describe_works(&mut idle);
    let mut silent = connect(&t);
    let mut trickle = connect(&t);
    let mut b = Vec::new();
    wire::encode_describe(&mut b, 1, 0);
    let f = frame(Kind::Describe, &b, &[], 5);
    let start = std::time::Instant::now();
    for byte in &f[..f.len() - 1] {
        if trickle.write_all(std::slice::from_ref(byte)).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(40));
        if start.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    wait_closed(&mut trickle, Duration::from_secs(5), "a trickling frame");
    assert!(start.elapsed() < Duration::from_secs(3), "cut after {:?}", start.elapsed());
    // Idle for several deadlines between frames, or since connecting:
    // still served.
    std::thread::sleep(Duration::from_millis(900));
    describe_works(&mut idle);
    describe_works(&mut silent);
}

/// Attack: 450 idle connections made 455 threads and exhausted the
/// target's descriptors. Connections are capped, in total and per peer
/// address, before any buffer is spent.
#[test]
fn connections_beyond_the_caps_are_closed_at_accept() {
    let t = target_with(r#"{"listen": "127.0.0.1:0", "max_connections": 8, "max_connections_per_address": 3}"#);
    let mut held: Vec<TcpStream> = (0..3).map(|_| connect(&t)).collect();
    for s in &mut held {
        describe_works(s);
    }
    let mut over = connect(&t);
    wait_closed(&mut over, Duration::from_secs(5), "a connection beyond the per-address cap");
    // One goes away: a new one is served again.
    drop(held.pop());
    let start = std::time::Instant::now();
    loop {
        let mut s = connect(&t);
        let mut b = Vec::new();
        wire::encode_describe(&mut b, 1, 0);
        let served = s.write_all(&frame(Kind::Describe, &b, &[], 9)).is_ok() && !closed_or_replied(&mut s);
        if served {
            break;
        }
        assert!(start.elapsed() < WAIT, "a freed slot was never given to a new connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in &mut held {
        describe_works(s);
    }
}

/// True if the connection closed instead of answering.
fn closed_or_replied(s: &mut TcpStream) -> bool {
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).is_err()
}

/// Attack: a peer answering one byte a second made open_segment(2 s)
/// return after 14 s. The whole exchange is bounded by the caller's timeout.
#[test]
fn open_segment_is_bounded_against_a_trickling_peer() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 256];
        let _ = s.read(&mut b);
        // A header, one byte every 100 ms.
        let h = wire::encode_header(&wire::header(Kind::DescribeReply, 1000, 0, 1));
        for byte in h.iter().chain([0u8; 1000].iter()) {
            if s.write_all(std::slice::from_ref(byte)).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let e = engine("{}");
    let start = std::time::Instant::now();
    let r = e.open_segment(&addr, None, Duration::from_millis(1000));
    assert!(r.is_err());
    assert!(start.elapsed() < Duration::from_millis(1800), "open took {:?}", start.elapsed());
    drop(e);
    let _ = server.join();
}

/// Attack: a fake peer's Describe claimed this process's pid, this boot id
/// and a "registration" at the address of an unregistered buffer; the
/// engine chose cma and overwrote the buffer. Same host is now proven over
/// the peer's local socket, never taken from the network: a peer that
/// names no local socket, this engine's own, or one nobody serves is
/// remote. Tcp is used, with the reason.
#[test]
fn a_peer_claiming_this_process_under_another_epoch_gets_no_one_sided_route() {
    let e = engine(r#"{"connections_per_peer": 1, "listen": "127.0.0.1:0"}"#);
    let own = e.segment_descriptor().local_socket;
    assert!(!own.is_empty(), "a listening engine serves a local socket");
    for (claim, why) in
        [("", "no local socket"), (own.as_str(), "own local socket"), ("orbite-00000000000fa4e0", "nothing listens")]
    {
        claiming(&e, claim, why);
    }
}

fn claiming(e: &TransferEngine, local_socket: &str, why: &str) {
    use orbite_core::segment::{Delta, ExportedRegistration, SegmentDescriptor};
    let victim = vec![0x5Au8; 65536];
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let fake = SegmentDescriptor {
        rdma_nics: 0,
        endpoint: addr.clone(),
        epoch: 0xfa4e,
        registry_version: 1,
        pid: std::process::id(),
        boot_id: orbite_core::segment::local_boot_id(),
        inbox: String::new(),
        local_socket: local_socket.to_owned(),
        registrations: vec![ExportedRegistration {
            rkeys: Vec::new(),
            id: RegistrationId::from_raw(1 | (1 << 32)),
            len: victim.len() as u64,
            permission: Permission::RemoteReadWrite,
            addr: victim.as_ptr() as u64,
            shm: None,
            device: None,
        }],
    };
    let server = std::thread::spawn(move || {
        // Answer the Describe and the Watch of one link (a data and a
        // watch connection), then hold them until the initiator goes away.
        let mut held = Vec::new();
        for _ in 0..2 {
            let Ok((mut s, _)) = l.accept() else { return };
            s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut h = [0u8; wire::HEADER_LEN];
            if s.read_exact(&mut h).is_ok() {
                let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 1 << 30 }).unwrap();
                let mut body = vec![0u8; h.body_len as usize];
                s.read_exact(&mut body).unwrap();
                let reply = match h.kind {
                    Kind::Describe => frame(Kind::DescribeReply, &fake.to_bytes(), &[], h.request),
                    Kind::Watch => {
                        let d = Delta { version: 1, reset: false, more: false, removed: vec![], added: vec![] };
                        let mut b = Vec::new();
                        wire::encode_changed(&mut b, fake.epoch, 1, &d.to_bytes());
                        frame(Kind::Changed, &b, &[], h.request)
                    }
                    _ => Vec::new(),
                };
                s.write_all(&reply).unwrap();
            }
            held.push(s);
        }
        for mut s in held {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut b = [0u8; 4096];
            while matches!(s.read(&mut b), Ok(n) if n > 0) {}
        }
    });
    let seg = e.open_segment(&addr, None, WAIT).unwrap();
    let local = region(e, 65536, Permission::RemoteReadWrite);
    fill(&local.mem, 3);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(RegistrationId::from_raw(1 | (1 << 32)), 0, 65536)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    let choice = t.route();
    assert_eq!(choice.route, Route::Tcp, "{choice:?}");
    assert!(choice.reason.contains(why), "the reason says why ({why}): {choice:?}");
    drop(t);
    drop(seg);
    drop(local);
    assert!(victim.iter().all(|b| *b == 0x5A), "the unregistered buffer was written");
    let _ = server.join();
}
