//! The whole peer protocol, deterministically: the initiator's machine
//! (`ClientConn`, after the authentication handshake run by `auth`'s
//! `Initiator`) against the target's (`ServerConn`, in front of a fake
//! target's memory), joined by byte pipes. No socket, no thread, no clock.
//!
//! Property: for random jobs (WRITEs and READs of valid and refused
//! ranges, notifications), random cuts of every send and receive (the
//! trickle a slow network gives), a secret that is right, wrong or absent,
//! and a connection that may break after any byte, every job completes
//! exactly once, with what a sequential model of the target says; bytes
//! land where they were sent and nowhere else; and once the connection is
//! gone the target holds nothing (its buffer and borrow charges are back).

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;

use super::client::{Bounds, ClientConn, ControlJob, Done, PeerFailure, PeerJob, unsent};
use super::open::{Exchange, Opened, Opening};
use super::server::{Close, ConnEnd, ServerBudget, ServerConn, TargetSide, TargetView};
use crate::charge::Counters;
use crate::registry::Registration;
use crate::segment::SegmentDescriptor;
use crate::transport::auth::{Dialed, Initiator, ResponderSelf, Secret};
use crate::transport::peer_errors::OpenError;
use crate::transport::routes::Mover;
use crate::transport::{CopyJob, CopyProgram, Span, TaskRange};
use crate::types::{Op, TaskEnd, TaskReport};
use crate::wire::{self, Kind, Limits, NotifyEnvelope, RemoteStatus, Request};

const EPOCH: u64 = 0x7a7a;
const MY_EPOCH: u64 = 0x1111;
const SOCKET: &str = "orbite-pair-test";
const LIMITS: Limits = Limits { max_body: 4096, max_data: 1 << 16 };
/// An initiator that waits as long as a case takes.
const PATIENT: Bounds = Bounds { stall: std::time::Duration::from_secs(3600), min_rate: 0, keepalive: None };
/// Bytes of each of the target's two registrations (1: read-write, 2:
/// read-only).
const REG: usize = 256;
/// Most notification bytes the target takes.
const MAX_NOTE: usize = 8;

/// The target: two registrations and the notifications it took.
struct Target {
    mem: UnsafeCell<[[u8; REG]; 2]>,
    notes: Mutex<Vec<Vec<u8>>>,
}

// SAFETY: one thread runs each case; the machines reach `mem` only
// through the iovecs `resolve` hands out, while the test holds no borrow.
unsafe impl Sync for Target {}

impl Target {
    fn new() -> Target {
        let mut mem = [[0u8; REG]; 2];
        for (r, m) in mem.iter_mut().enumerate() {
            for (i, b) in m.iter_mut().enumerate() {
                *b = (i * 3 + r * 101) as u8;
            }
        }
        Target { mem: UnsafeCell::new(mem), notes: Mutex::new(Vec::new()) }
    }

    fn memory(&self) -> [[u8; REG]; 2] {
        // SAFETY: read between pumps, while no machine holds an iovec.
        unsafe { *self.mem.get() }
    }
}

/// How the target checks one range; the model uses the same rule.
fn check(reg: u64, offset: u64, len: u64, write: bool) -> Result<usize, RemoteStatus> {
    let i = match reg {
        1 | 2 => (reg - 1) as usize,
        _ => return Err(RemoteStatus::UnknownRegistration),
    };
    if write && i == 1 {
        return Err(RemoteStatus::PermissionDenied);
    }
    if offset.checked_add(len).is_none_or(|end| end > REG as u64) {
        return Err(RemoteStatus::OutOfBounds);
    }
    Ok(i)
}

impl TargetView for Target {
    fn epoch(&self) -> u64 {
        EPOCH
    }

    fn descriptor(&self) -> Vec<u8> {
        descriptor().to_bytes()
    }

    fn resolve(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        _loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        for d in req.descs() {
            let i = check(d.registration, d.offset, d.len, write).map_err(|s| (s, String::new()))?;
            // SAFETY: in bounds of the target's memory (checked above).
            let base = unsafe { (*self.mem.get())[i].as_mut_ptr().add(d.offset as usize) };
            iovs.push(crate::transport::sock::iov(base as u64, d.len));
        }
        Ok(())
    }

    fn changes(&self, since: u64, _budget: usize) -> crate::segment::Delta {
        changes(since)
    }

    fn registry_version(&self) -> u64 {
        VERSION
    }

    fn limits(&self) -> Limits {
        LIMITS
    }

    fn responder(&self, _at: ConnEnd) -> ResponderSelf {
        ResponderSelf { epoch: EPOCH, advertised: None, local_socket: Some(SOCKET.into()), reached_at: None }
    }
}

impl TargetSide for Target {
    fn view(&self) -> &dyn TargetView {
        self
    }

    fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
        if env.payload.len() > MAX_NOTE {
            return Err((RemoteStatus::NotificationTooLarge, String::new()));
        }
        self.notes.lock().push(env.payload.to_vec());
        Ok(())
    }
}

/// The target's registry version.
const VERSION: u64 = 7;

/// What changed on the target after version `since` (its registrations
/// are not exported: only the version moves).
fn changes(since: u64) -> crate::segment::Delta {
    crate::segment::Delta { version: VERSION.max(since), reset: since > VERSION, ..Default::default() }
}

/// What the target describes.
fn descriptor() -> SegmentDescriptor {
    SegmentDescriptor {
        rdma_nics: 0,
        endpoint: "target".into(),
        epoch: EPOCH,
        registry_version: 3,
        pid: 1,
        boot_id: [9; 16],
        inbox: String::new(),
        local_socket: SOCKET.into(),
        registrations: Vec::new(),
    }
}

#[derive(Debug, Clone)]
enum Job {
    Write {
        reg: u64,
        offset: u64,
        data: Vec<u8>,
    },
    Read {
        reg: u64,
        offset: u64,
        len: u64,
    },
    Notify(Vec<u8>),
    /// Asks what changed after this registry version.
    Refresh(u64),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Secrets {
    /// Neither side has one.
    None,
    /// Both have the same.
    Same,
    /// The initiator's differs.
    Wrong,
}

/// How a job ended, as the model and the run see it.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// A task: bytes done, how it ended, and for a READ what landed.
    Task { done: u64, end: TaskEnd, read: Vec<u8> },
    /// A control request: its reply's body, or refused with a status, or
    /// lost.
    Control(Result<Vec<u8>, Option<RemoteStatus>>),
}

struct TestJob {
    program: Arc<CopyProgram>,
    id: usize,
}

impl CopyJob for TestJob {
    fn program(&self) -> &CopyProgram {
        &self.program
    }
    fn task(&self) -> u32 {
        0
    }
    fn finish(self, _report: TaskReport) {}
}

/// A job's program: its local bytes (`local`, at least `len` long) in up
/// to three spans, so that frames carry several descriptors.
fn program(op: Op, reg: u64, offset: u64, local: &mut [u8]) -> Arc<CopyProgram> {
    let len = local.len() as u64;
    let base = local.as_mut_ptr() as u64;
    let cuts = [0, len / 3, len * 2 / 3, len];
    let spans: Vec<Span> = cuts
        .windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| Span { local: base + w[0], remote: offset + w[0], remote_reg: reg, len: w[1] - w[0] })
        .collect();
    let tasks = vec![TaskRange { first_span: 0, end_span: spans.len() as u32, bytes: len }];
    Arc::new(CopyProgram { op, mover: Mover::Frames { staging: None }, spans, tasks })
}

/// The sequential model: what each job ends with, and the target's memory
/// after the jobs that completed, given that the connection is usable.
fn model(jobs: &[Job]) -> (Vec<Outcome>, [[u8; REG]; 2], Vec<Vec<u8>>) {
    let mut mem = Target::new().memory();
    let mut notes = Vec::new();
    let refused = |len: u64| Outcome::Task {
        done: 0,
        end: TaskEnd::Failed { effect_unknown: false },
        read: vec![0; len as usize],
    };
    let out = jobs
        .iter()
        .map(|j| match j {
            Job::Write { reg, offset, data } => match check(*reg, *offset, data.len() as u64, true) {
                Ok(i) => {
                    mem[i][*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
                    Outcome::Task { done: data.len() as u64, end: TaskEnd::Complete, read: Vec::new() }
                }
                Err(_) => refused(0),
            },
            Job::Read { reg, offset, len } => match check(*reg, *offset, *len, false) {
                Ok(i) => Outcome::Task {
                    done: *len,
                    end: TaskEnd::Complete,
                    read: mem[i][*offset as usize..(*offset + *len) as usize].to_vec(),
                },
                Err(_) => refused(*len),
            },
            Job::Notify(p) if p.len() > MAX_NOTE => Outcome::Control(Err(Some(RemoteStatus::NotificationTooLarge))),
            Job::Notify(p) => {
                notes.push(p.clone());
                Outcome::Control(Ok(Vec::new()))
            }
            Job::Refresh(since) => Outcome::Control(Ok(changes(*since).to_bytes())),
        })
        .collect();
    (out, mem, notes)
}

/// Bytes in flight one way, and the cut sizes that move them.
struct Pipe {
    bytes: VecDeque<u8>,
    moved: usize,
}

/// The run's wiring: both machines, both pipes, the cut sizes, and when
/// the connection breaks (after that many bytes moved in all).
struct Wire<'a> {
    c2s: Pipe,
    s2c: Pipe,
    cuts: std::iter::Cycle<std::slice::Iter<'a, usize>>,
    break_at: Option<usize>,
    broken: bool,
}

impl Wire<'_> {
    /// How many bytes the next send or receive moves (0 once broken).
    fn cut(&mut self) -> usize {
        if self.broken {
            return 0;
        }
        let want = *self.cuts.next().expect("cycled");
        match self.break_at {
            Some(at) => {
                let left = at.saturating_sub(self.c2s.moved + self.s2c.moved);
                if left == 0 {
                    self.broken = true;
                }
                want.min(left)
            }
            None => want,
        }
    }
}

/// Copies up to `want` bytes out of `iovs` onto `pipe`; the count.
fn take(iovs: &[libc::iovec], want: usize, pipe: &mut Pipe) -> usize {
    let mut n = 0;
    for v in iovs {
        let k = v.iov_len.min(want - n);
        // SAFETY: the machine's iovecs address readable memory for the call.
        pipe.bytes.extend(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), k) });
        n += k;
        if n == want {
            break;
        }
    }
    pipe.moved += n;
    n
}

/// Copies up to `want` bytes off `pipe` into `iovs`; the count.
fn give(iovs: &[libc::iovec], want: usize, pipe: &mut Pipe) -> usize {
    let want = want.min(pipe.bytes.len());
    let mut n = 0;
    for v in iovs {
        let k = v.iov_len.min(want - n);
        for (i, b) in pipe.bytes.drain(..k).enumerate() {
            // SAFETY: the machine's iovecs address writable memory for the
            // call, `k` bytes long at most.
            unsafe { *v.iov_base.cast::<u8>().add(i) = b };
        }
        n += k;
        if n == want {
            break;
        }
    }
    n
}

/// The server's turn: reads what it can, sends what it has. `Err`: it
/// closed the connection.
fn serve(s: &mut ServerConn, side: &Target, w: &mut Wire<'_>) -> Result<bool, Close> {
    let mut progress = false;
    loop {
        let mut moved = false;
        if !w.c2s.bytes.is_empty() {
            let want = w.cut();
            if let Some(into) = s.recv_buf() {
                let n = give(into, want, &mut w.c2s);
                if n > 0 {
                    moved = true;
                    let event = s.received(n, side.view())?;
                    // The driver's part: what the machine asks for.
                    crate::transport::server::perform(s, side, event);
                }
            }
        }
        if let Some(out) = s.send_buf() {
            let want = w.cut();
            let n = take(out, want, &mut w.s2c);
            if n > 0 {
                moved = true;
                s.sent(n);
            }
        }
        if !moved {
            return Ok(progress);
        }
        progress = true;
    }
}

/// Runs one exchange at open against the server: how it ended, or
/// `None` if the connection broke (or the target closed it) first.
fn opening(mut m: Opening, s: &mut ServerConn, side: &Target, w: &mut Wire<'_>) -> Option<Result<Opened, OpenError>> {
    loop {
        let mut progress = false;
        let out = m.to_send();
        if !out.is_empty() {
            let want = w.cut().min(out.len());
            w.c2s.bytes.extend(&out[..want]);
            w.c2s.moved += want;
            m.sent(want);
            progress |= want > 0;
        }
        let served = serve(s, side, w);
        progress |= matches!(served, Ok(true));
        while !w.s2c.bytes.is_empty() {
            let want = w.cut().min(w.s2c.bytes.len());
            if want == 0 {
                break;
            }
            let into = m.want();
            let n = want.min(into.len());
            for (b, x) in into.iter_mut().zip(w.s2c.bytes.drain(..n)) {
                *b = x;
            }
            progress = true;
            match m.received(n) {
                Ok(None) => {}
                done => return done.transpose(),
            }
        }
        if !progress || served.is_err() && w.s2c.bytes.is_empty() {
            return None;
        }
    }
}

/// Runs the jobs over one connection; what each ended with (by job), the
/// bytes each READ landed, and the target afterwards.
fn run(
    jobs: &[Job],
    secrets: Secrets,
    cuts: &[usize],
    break_at: Option<usize>,
) -> (Vec<Outcome>, Target, Arc<Counters>) {
    let side = Target::new();
    let counters = Arc::new(Counters::default());
    let budget = ServerBudget { counters: counters.clone(), ..ServerBudget::default() };
    let target_secret = Arc::new(Secret::from_bytes(&[1u8; 32]));
    let secret = (secrets != Secrets::None).then(|| target_secret.clone());
    let mut s = ServerConn::new(budget, secret, ConnEnd::Local, std::time::Instant::now());
    let mut w = Wire {
        c2s: Pipe { bytes: VecDeque::new(), moved: 0 },
        s2c: Pipe { bytes: VecDeque::new(), moved: 0 },
        cuts: cuts.iter().cycle(),
        break_at,
        broken: false,
    };
    let mut locals: Vec<Vec<u8>> = jobs
        .iter()
        .map(|j| match j {
            Job::Write { data, .. } => data.clone(),
            Job::Read { len, .. } => vec![0u8; *len as usize],
            Job::Notify(_) | Job::Refresh(_) => Vec::new(),
        })
        .collect();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; jobs.len()];
    // Notifications in the order they were started: the machine completes
    // them in that order (it serves requests in order).
    let mut notes_started: VecDeque<usize> = VecDeque::new();
    let record = |outcomes: &mut Vec<Option<Outcome>>,
                  notes_started: &mut VecDeque<usize>,
                  d: Done<TestJob>,
                  locals: &[Vec<u8>]| {
        let (id, o) = match d {
            Done::Task(j, r) => {
                let read = match jobs[j.id] {
                    Job::Read { .. } => locals[j.id].clone(),
                    _ => Vec::new(),
                };
                (j.id, Outcome::Task { done: r.done, end: r.end, read })
            }
            Done::Control(_, r) => (
                notes_started.pop_front().expect("a notification was started"),
                Outcome::Control(match r {
                    Ok(body) => Ok(body),
                    Err(PeerFailure::Refused(status, _)) => Err(Some(status)),
                    Err(PeerFailure::Lost(_)) => Err(None),
                }),
            ),
        };
        assert!(outcomes[id].is_none(), "job {id} completed twice");
        outcomes[id] = Some(o);
    };

    // The exchanges at open, as link.rs runs them: the handshake (with a
    // secret), then the Describe.
    let mut open = true;
    if secrets != Secrets::None {
        let mine = match secrets {
            Secrets::Wrong => Arc::new(Secret::from_bytes(&[2u8; 32])),
            _ => target_secret.clone(),
        };
        let dialed = Dialed { name: SOCKET.into(), reached: None };
        let hs = Initiator::new(mine, MY_EPOCH, Some(EPOCH), &dialed, [7u8; wire::AUTH_NONCE]);
        let proved = opening(Opening::new(Exchange::Authenticate(hs), LIMITS), &mut s, &side, &mut w);
        open = matches!(proved, Some(Ok(Opened::Proved(EPOCH))));
    }
    if open {
        let ask = Exchange::Describe { my_epoch: MY_EPOCH, expected: Some(EPOCH), max_descriptor: 1 << 16 };
        match opening(Opening::new(ask, LIMITS), &mut s, &side, &mut w) {
            Some(Ok(Opened::Described(d, _))) => assert_eq!(d, descriptor(), "the descriptor arrives whole"),
            Some(other) => panic!("describe: {other:?}"),
            // The connection broke.
            None => open = false,
        }
    }

    // The data path.
    let mut c: ClientConn<TestJob> = ClientConn::new(EPOCH, LIMITS, PATIENT, std::time::Instant::now());
    let mut next = 0;
    let mut lost = !open;
    let mut server_closed = false;
    while next < jobs.len() || c.in_flight() > 0 {
        if lost {
            for d in c.fail_all("lost") {
                record(&mut outcomes, &mut notes_started, d, &locals);
            }
            while next < jobs.len() {
                let i = next;
                next += 1;
                let pj = job(&jobs[i], i, &mut locals[i]);
                if matches!(pj, PeerJob::Control(_)) {
                    notes_started.push_back(i);
                }
                record(&mut outcomes, &mut notes_started, unsent(pj, "lost".into()), &locals);
            }
            break;
        }
        while c.can_start() && next < jobs.len() {
            let i = next;
            next += 1;
            let pj = job(&jobs[i], i, &mut locals[i]);
            if matches!(pj, PeerJob::Control(_)) {
                notes_started.push_back(i);
            }
            c.start(pj, i as u64 + 1, std::time::Instant::now());
        }
        let mut progress = false;
        while let Some(out) = c.send_buf() {
            let want = w.cut();
            let n = take(out, want, &mut w.c2s);
            if n == 0 {
                break;
            }
            progress = true;
            c.sent(n, std::time::Instant::now());
        }
        if !server_closed {
            match serve(&mut s, &side, &mut w) {
                Ok(p) => progress |= p,
                Err(_) => server_closed = true,
            }
        }
        while !w.s2c.bytes.is_empty() {
            let want = w.cut();
            let Some(into) = c.recv_buf() else { break };
            let n = give(into, want, &mut w.s2c);
            if n == 0 {
                break;
            }
            progress = true;
            let mut d = None;
            let r = c.received(n, &mut d, std::time::Instant::now());
            if let Some(d) = d {
                record(&mut outcomes, &mut notes_started, d, &locals);
            }
            if r.is_err() {
                lost = true;
                break;
            }
        }
        if !progress {
            // Nothing moves any more: the connection broke (or the target
            // closed it).
            lost = true;
        }
    }
    drop(s);
    let outcomes =
        outcomes.into_iter().enumerate().map(|(i, o)| o.unwrap_or_else(|| panic!("job {i} never completed"))).collect();
    (outcomes, side, counters)
}

/// Job `i` for the client machine.
fn job(j: &Job, i: usize, local: &mut [u8]) -> PeerJob<TestJob> {
    match j {
        Job::Write { reg, offset, .. } => {
            PeerJob::Task(TestJob { program: program(Op::Write, *reg, *offset, local), id: i })
        }
        Job::Read { reg, offset, .. } => {
            PeerJob::Task(TestJob { program: program(Op::Read, *reg, *offset, local), id: i })
        }
        Job::Notify(p) => {
            let mut body = Vec::new();
            let env = NotifyEnvelope {
                sender_endpoint: "initiator",
                sender_epoch: MY_EPOCH,
                target_epoch: EPOCH,
                payload: p,
            };
            wire::encode_notify(&mut body, &env);
            let _ = i;
            PeerJob::Control(ControlJob { kind: Kind::Notify, flags: 0, body, done: Box::new(|_| {}) })
        }
        Job::Refresh(since) => {
            let mut body = Vec::new();
            let ask = wire::DescribeSince {
                initiator_epoch: MY_EPOCH,
                expected_epoch: EPOCH,
                since: *since,
                max_reply: 4096,
            };
            wire::encode_describe_since(&mut body, &ask);
            PeerJob::Control(ControlJob { kind: Kind::DescribeSince, flags: 0, body, done: Box::new(|_| {}) })
        }
    }
}

fn jobs() -> impl Strategy<Value = Vec<Job>> {
    let job = prop_oneof![
        4 => (0u64..4, 0u64..280, prop::collection::vec(any::<u8>(), 1..48))
            .prop_map(|(reg, offset, data)| Job::Write { reg, offset, data }),
        3 => (0u64..4, 0u64..280, 1u64..48).prop_map(|(reg, offset, len)| Job::Read { reg, offset, len }),
        1 => prop::collection::vec(any::<u8>(), 0..12).prop_map(Job::Notify),
        1 => (0u64..12).prop_map(Job::Refresh),
    ];
    prop::collection::vec(job, 1..24)
}

fn secrets() -> impl Strategy<Value = Secrets> {
    prop_oneof![3 => Just(Secrets::None), 3 => Just(Secrets::Same), 1 => Just(Secrets::Wrong)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every job completes exactly once; on a connection that never
    /// breaks, with what the model says; on one that breaks, the jobs the
    /// target answered before are exact and the others failed, with only
    /// WRITEs on the wire of unknown effect; bytes land only where some
    /// job wrote them; the target holds nothing afterwards.
    #[test]
    fn the_protocol_matches_a_sequential_model(
        jobs in jobs(),
        secrets in secrets(),
        cuts in prop::collection::vec(1usize..80, 1..6),
        break_at in prop::option::weighted(0.3, 0usize..3000),
    ) {
        let (want, want_mem, want_notes) = model(&jobs);
        let (got, side, counters) = run(&jobs, secrets, &cuts, break_at);
        let mem = side.memory();
        let baseline = Target::new().memory();
        prop_assert_eq!(counters.snapshot(), Counters::default().snapshot(), "the target holds nothing afterwards");
        if secrets == Secrets::Wrong {
            for (i, o) in got.iter().enumerate() {
                let failed = matches!(o, Outcome::Control(Err(None)) | Outcome::Task { done: 0, end: TaskEnd::Failed { effect_unknown: false }, .. });
                prop_assert!(failed, "job {} ran without authentication: {:?}", i, o);
            }
            prop_assert_eq!(mem, baseline, "nothing lands without authentication");
            prop_assert!(side.notes.lock().is_empty());
            return Ok(());
        }
        if break_at.is_none() {
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g, w, "job {} ({:?})", i, jobs[i]);
            }
            prop_assert_eq!(mem, want_mem);
            prop_assert_eq!(&*side.notes.lock(), &want_notes);
            return Ok(());
        }
        // A break: the jobs before the first that did not end as the model
        // says ended exactly so; every later one failed (a READ may have
        // landed a prefix of the model's bytes; a notification is lost).
        let first_off = got.iter().zip(&want).position(|(g, w)| g != w).unwrap_or(got.len());
        for (i, g) in got.iter().enumerate().skip(first_off) {
            match (g, &want[i]) {
                (Outcome::Control(r), _) => prop_assert!(r.is_err(), "job {} after the break: {:?}", i, g),
                (Outcome::Task { done, end: TaskEnd::Failed { .. }, read }, Outcome::Task { read: model_read, .. }) => {
                    if let Job::Read { .. } = jobs[i] {
                        if !model_read.is_empty() {
                            prop_assert_eq!(&read[..*done as usize], &model_read[..*done as usize], "job {} landed a prefix", i);
                        }
                    } else {
                        prop_assert_eq!(*done, 0);
                    }
                }
                _ => prop_assert!(false, "job {} after the break: {:?} (model {:?})", i, g, want[i]),
            }
        }
        // Every byte of the target is its first value or one some WRITE
        // (of a job not refused by the model) put there.
        for r in 0..2 {
            for b in 0..REG {
                if mem[r][b] == baseline[r][b] {
                    continue;
                }
                let written = jobs.iter().any(|j| match j {
                    Job::Write { reg, offset, data } => {
                        check(*reg, *offset, data.len() as u64, true) == Ok(r)
                            && (*offset as usize..*offset as usize + data.len()).contains(&b)
                            && data[b - *offset as usize] == mem[r][b]
                    }
                    _ => false,
                });
                prop_assert!(written, "byte {} of registration {} was never written with {}", b, r + 1, mem[r][b]);
            }
        }
    }
}

/// Feeds `bytes` to the target at `now` (the driver's part included).
fn feed(s: &mut ServerConn, side: &Target, bytes: &[u8], now: std::time::Instant) {
    let mut at = 0;
    while at < bytes.len() {
        let into = s.recv_buf().expect("the target takes bytes");
        let n = give(into, bytes.len() - at, &mut Pipe { bytes: bytes[at..].iter().copied().collect(), moved: 0 });
        at += n;
        let event = s.received(n, side.view()).expect("a well-formed stream");
        crate::transport::server::perform(s, side, event);
    }
    s.tick(now, true);
}

/// The target's clock runs on the `now`s its driver gives: a connection
/// that owes its handshake expires a frame bound after accept; an idle
/// one after the idle bound (a watch never); an exchange after its
/// allowance, the frame bound plus its bytes at the minimum rate, however
/// its bytes trickle in.
#[test]
fn the_target_times_out_by_the_clock_it_is_given() {
    use super::server::{Deadlines, Expired};
    use std::time::{Duration, Instant};
    let d =
        Deadlines { frame_timeout: Duration::from_secs(1), idle_timeout: Some(Duration::from_secs(5)), min_rate: 1000 };
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let side = Target::new();

    let secret = Some(Arc::new(Secret::from_bytes(&[1u8; 32])));
    let s = ServerConn::new(ServerBudget::default(), secret, ConnEnd::Local, t0);
    assert_eq!(s.expired(at(1000), &d), None);
    assert_eq!(s.expired(at(1001), &d), Some(Expired::Handshake), "the handshake counts from accept");

    let mut s = ServerConn::new(ServerBudget::default(), None, ConnEnd::Local, t0);
    s.tick(t0, false);
    assert_eq!(s.expired(at(5000), &d), None);
    assert_eq!(s.expired(at(5001), &d), Some(Expired::Idle));
    s.subscribed();
    assert_eq!(s.expired(at(60_000), &d), None, "a watch is never idle");

    // A WRITE of 200 bytes: its header and body at 10 s, its payload a
    // byte at a time until 11 s; allowed 1 s + 200 bytes at 1000 B/s.
    let mut s = ServerConn::new(ServerBudget::default(), None, ConnEnd::Local, t0);
    let mut body = Vec::new();
    let d200 = wire::RemoteDesc { registration: 1, offset: 0, len: 200 };
    wire::encode_request(&mut body, EPOCH, [d200].into_iter());
    let mut frame = wire::encode_header(&wire::header(Kind::Write, body.len(), 200, 1)).to_vec();
    frame.extend_from_slice(&body);
    feed(&mut s, &side, &frame[..5], at(10_000));
    feed(&mut s, &side, &frame[5..], at(10_000));
    for i in 0..199u64 {
        feed(&mut s, &side, &[7], at(10_000 + i * 5));
    }
    assert_eq!(s.expired(at(11_200), &d), None, "a trickle within its allowance");
    assert_eq!(s.expired(at(11_201), &d), Some(Expired::Stalled), "the exchange outlived its allowance");
    feed(&mut s, &side, &[7], at(11_100));
    let mut reply = Pipe { bytes: VecDeque::new(), moved: 0 };
    while let Some(out) = s.send_buf() {
        let n = take(out, usize::MAX, &mut reply);
        s.sent(n);
    }
    s.tick(at(11_100), true);
    assert_eq!(s.expired(at(11_300), &d), None, "acknowledged: idle again");
    assert_eq!(side.memory()[0][..200], [7u8; 200]);
}

/// The initiator's clock runs on the `now`s its driver gives: an idle
/// connection sends a keepalive when due; with a request outstanding the
/// peer is lost after the stall bound of silence, or when a request goes
/// out slower than the minimum rate however its bytes trickle.
#[test]
fn the_initiator_times_out_by_the_clock_it_is_given() {
    use super::client::Timeout;
    use std::time::{Duration, Instant};
    let b = Bounds { stall: Duration::from_secs(1), min_rate: 1000, keepalive: Some(Duration::from_secs(20)) };
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut c: ClientConn<TestJob> = ClientConn::new(EPOCH, LIMITS, b, t0);
    assert_eq!((c.deadline(), c.expired(at(60_000))), (None, None), "nothing awaited: never lost");
    assert_eq!(c.keepalive_at(), Some(at(20_000)));
    assert!(!c.keep_alive(at(19_999)));
    assert!(c.keep_alive(at(20_000)));
    let mut wire = Pipe { bytes: VecDeque::new(), moved: 0 };
    while let Some(out) = c.send_buf() {
        let n = take(out, usize::MAX, &mut wire);
        c.sent(n, at(20_000));
    }
    assert_eq!(c.keepalive_at(), Some(at(40_000)), "the next one counts from this one");

    let mut local = vec![5u8; 100];
    c.start(job(&Job::Write { reg: 1, offset: 0, data: local.clone() }, 0, &mut local), 1, at(30_000));
    assert_eq!(c.keepalive_at(), None, "busy: no keepalive");
    assert_eq!(c.deadline(), Some(at(31_000)));
    assert_eq!(c.expired(at(30_999)), None);
    assert_eq!(c.expired(at(31_000)), Some(Timeout::Silent(Duration::from_secs(1))));
    // A byte every 100 ms keeps it alive, until the request has taken
    // longer than 1 s plus its bytes at 1000 B/s.
    let len = c.send_len();
    let mut t = 30_000;
    let mut lost = None;
    while let Some(out) = c.send_buf() {
        t += 100;
        let n = take(out, 1, &mut wire);
        c.sent(n, at(t));
        if let Some(why) = c.expired(at(t)) {
            lost = Some((t, why));
            break;
        }
    }
    let bound = 30_000 + 1000 + len * 1000 / 1000;
    assert_eq!(lost, Some((bound.div_ceil(100) * 100, Timeout::TooSlow)), "{len} bytes");
}

/// A watch's subscription through the open machine and the target's: the
/// target asks its driver to subscribe (here the test, as `watchers`
/// would, pushes what changed after the version asked from), and the
/// initiator gets that first push; a target whose watchers are full
/// refuses, and the initiator knows it asks instead.
#[test]
fn a_watch_subscription_gets_its_first_changes_or_is_refused() {
    use super::server::Subscribe;
    for full in [false, true] {
        let side = Target::new();
        let mut s = ServerConn::new(ServerBudget::default(), None, ConnEnd::Local, std::time::Instant::now());
        let mut m = Opening::new(Exchange::Watch { epoch: EPOCH, since: 3, max_reply: 4096 }, LIMITS);
        let request = m.to_send().to_vec();
        m.sent(request.len());
        let mut at = 0;
        let mut subscribed = None;
        while at < request.len() {
            let into = s.recv_buf().expect("the target takes the request");
            let n =
                give(into, request.len() - at, &mut Pipe { bytes: request[at..].iter().copied().collect(), moved: 0 });
            at += n;
            let event = s.received(n, side.view()).expect("a well-formed watch");
            subscribed = subscribed.or(crate::transport::server::perform(&mut s, &side, event));
        }
        let Some(Subscribe { epoch, request: id, since, .. }) = subscribed else { panic!("no subscription asked") };
        assert_eq!((epoch, since), (EPOCH, 3));
        let mut reply = Pipe { bytes: VecDeque::new(), moved: 0 };
        if full {
            s.refuse_request(id, RemoteStatus::ResourceExhausted, "watchers are full");
            while let Some(out) = s.send_buf() {
                let n = take(out, usize::MAX, &mut reply);
                s.sent(n);
            }
        } else {
            let mut body = Vec::new();
            wire::encode_changed(&mut body, EPOCH, since, &changes(since).to_bytes());
            reply.bytes.extend(wire::encode_header(&wire::header(Kind::Changed, body.len(), 0, id)));
            reply.bytes.extend(body);
        }
        let mut done = None;
        while done.is_none() {
            let into = m.want();
            let n = into.len().min(reply.bytes.len());
            for (b, x) in into.iter_mut().zip(reply.bytes.drain(..n)) {
                *b = x;
            }
            done = m.received(n).expect("a well-formed answer");
        }
        match (full, done) {
            (false, Some(Opened::Watching(base, delta))) => assert_eq!((base, delta), (3, changes(3))),
            (true, Some(Opened::WatchersFull)) => {}
            (_, other) => panic!("full {full}: {other:?}"),
        }
    }
}
