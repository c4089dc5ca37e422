//! The initiator side of one peer connection, as a state machine: jobs and
//! bytes in, frames out and completions, no sockets, threads or clocks.
//!
//! A job becomes one request frame ([`ClientConn::start`]: its header and
//! body, and a WRITE's payload straight from registered memory) with a
//! request id; up to [`PIPELINE_DEPTH`] requests are outstanding, and their
//! replies must come in the order they were sent. The driver sends what
//! [`ClientConn::send_buf`] holds, receives into what
//! [`ClientConn::recv_buf`] gives (a reply's header and body, then a
//! READ's bytes straight into local registered memory) and reports the
//! bytes moved; each reply completes its job ([`Done`]). A reply that
//! breaks the protocol (another request's id, an unexpected kind, a
//! malformed body) loses the peer; so does any I/O failure the driver sees
//! ([`ClientConn::fail_all`]). What a lost peer's jobs report follows one
//! rule: a WRITE that was sent may have landed (effect unknown); a READ
//! reports exactly the bytes that landed here; a refusal moved nothing.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::transport::proto::FrameIn;
use crate::transport::sock::{advance, iov};
use crate::transport::{CopyJob, TaskReport};
use crate::types::{Op, TaskEnd};
use crate::wire::{self, Header, Kind, Limits, Message, RemoteDesc, RemoteStatus, WireError};

/// Requests a connection keeps outstanding: the next request is on the
/// wire while the previous reply is still coming, so neither side idles
/// for a round trip between tasks.
pub(crate) const PIPELINE_DEPTH: usize = 2;

/// Why a peer operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerFailure {
    /// The connection broke or timed out; the peer is lost.
    Lost(String),
    /// The target refused with a typed status.
    Refused(RemoteStatus, String),
}

/// What a control request hears back: the reply's body (empty for an
/// acknowledgement), or why there is none.
pub(crate) type ControlDone = Box<dyn FnOnce(Result<&[u8], PeerFailure>) + Send>;

/// A control request for a peer (a notification, a borrow or a return, a
/// refresh): one frame with an encoded body, answered by one reply.
pub(crate) struct ControlJob {
    pub kind: Kind,
    pub flags: u8,
    pub body: Vec<u8>,
    pub done: ControlDone,
}

impl ControlJob {
    fn expected_reply(&self) -> Kind {
        match self.kind {
            Kind::Borrow => Kind::BorrowAck,
            Kind::Return => Kind::ReturnAck,
            Kind::DescribeSince => Kind::DescribeDelta,
            Kind::RdmaConnect => Kind::RdmaAccept,
            _ => Kind::NotifyAck,
        }
    }
}

/// A job for a peer's link.
pub(crate) enum PeerJob<J> {
    Task(J),
    Control(ControlJob),
}

/// A completed job: a task with its report, or a control request with its
/// reply body or failure. The driver calls `finish` / `done` outside the
/// machine.
pub(crate) enum Done<J> {
    Task(J, TaskReport),
    Control(ControlJob, Result<Vec<u8>, PeerFailure>),
}

impl<J: CopyJob> Done<J> {
    /// Delivers the completion.
    pub fn deliver(self) {
        match self {
            Done::Task(j, report) => j.finish(report),
            Done::Control(n, Ok(body)) => (n.done)(Ok(&body)),
            Done::Control(n, Err(e)) => (n.done)(Err(e)),
        }
    }
}

/// A job that was never put on the wire: nothing moved, effect known.
pub(crate) fn unsent<J: CopyJob>(job: PeerJob<J>, why: String) -> Done<J> {
    match job {
        PeerJob::Task(j) => {
            let planned = j.planned();
            Done::Task(j, TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: false } })
        }
        PeerJob::Control(n) => Done::Control(n, Err(PeerFailure::Lost(why))),
    }
}

/// A reply broke the protocol (the peer is then lost): how.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("protocol violation: {0}")]
pub(crate) struct Violation(pub WireError);

/// What a well-formed reply says.
enum Said {
    /// A refusal.
    Refused(RemoteStatus, String),
    /// An answer of this kind.
    Answer(Kind),
}

enum Input {
    /// A reply frame (header and body).
    Frame,
    /// A READ reply's bytes, landing in the front task's local spans.
    Payload { first: usize, done: u64 },
}

/// How long the initiator waits for its peer: the bounds the machine's
/// clock keeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Silence, while a request is outstanding, after which the peer is
    /// lost.
    pub stall: Duration,
    /// Slowest accepted peer, bytes per second (0: no rate bound).
    pub min_rate: u64,
    /// A connection with nothing outstanding sends a keepalive this long
    /// after its last bytes (`None`: never).
    pub keepalive: Option<Duration>,
}

impl Bounds {
    /// When an I/O of `bytes` starting at `now` must be done by, at the
    /// minimum rate (`None`: no rate bound).
    pub fn until(&self, now: Instant, bytes: u64) -> Option<Instant> {
        match self.min_rate {
            0 => None,
            rate => now.checked_add(self.stall.saturating_add(crate::time::at_rate(bytes, rate))),
        }
    }
}

/// Why the machine's clock says the peer is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Timeout {
    /// No byte moved for the stall bound while a request was outstanding.
    #[error("connection lost: no sign of life for {} ms", .0.as_millis())]
    Silent(Duration),
    /// A request went out, or its reply came in, slower than the minimum
    /// rate.
    #[error("connection lost: slower than the minimum peer rate")]
    TooSlow,
}

/// The connection's clock, from the `now`s its driver gives.
struct Clock {
    bounds: Bounds,
    /// When a byte last moved, or a wait began.
    last_io: Instant,
    /// When the request being sent must be out (minimum rate).
    send_until: Option<Instant>,
    /// Whether the oldest outstanding reply's bound started (its request
    /// is all out), and when it must be in (minimum rate).
    reply_timed: bool,
    reply_until: Option<Instant>,
}

/// One connection's initiator side.
pub(crate) struct ClientConn<J> {
    epoch: u64,
    limits: Limits,
    inflight: VecDeque<(PeerJob<J>, u64)>,
    out: Vec<u8>,
    out_iovs: Vec<libc::iovec>,
    out_first: usize,
    input: Input,
    frame: FrameIn,
    /// Where request bodies are encoded.
    scratch: Vec<u8>,
    in_iovs: Vec<libc::iovec>,
    lost: Option<String>,
    clock: Clock,
    /// The peer refused a task for naming a registration that is no longer
    /// live: the view it was resolved from lags (the driver takes this).
    pub lapsed: bool,
}

// SAFETY: the iovecs point into buffers this value owns or into registered
// memory the jobs' range loans keep alive; only the thread that holds the
// machine uses them.
unsafe impl<J: Send> Send for ClientConn<J> {}

impl<J: CopyJob> ClientConn<J> {
    /// A machine for a connection to the peer epoch `epoch`, opened at
    /// `now`, waiting within `bounds`.
    pub fn new(epoch: u64, limits: Limits, bounds: Bounds, now: Instant) -> Self {
        ClientConn {
            clock: Clock { bounds, last_io: now, send_until: None, reply_timed: false, reply_until: None },
            epoch,
            limits,
            inflight: VecDeque::with_capacity(PIPELINE_DEPTH),
            out: Vec::new(),
            out_iovs: Vec::new(),
            out_first: 0,
            input: Input::Frame,
            frame: FrameIn::new(),
            scratch: Vec::new(),
            in_iovs: Vec::new(),
            lost: None,
            lapsed: false,
        }
    }

    /// Requests outstanding (sent or being sent, reply not complete).
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether another request may start now: the pipeline has room and
    /// the previous request is all on the wire. (Once the peer is lost the
    /// driver fails new jobs unsent instead of starting them.)
    pub fn can_start(&self) -> bool {
        self.inflight.len() < PIPELINE_DEPTH && self.out_first >= self.out_iovs.len()
    }

    /// Puts `job` on the wire as request `id` at `now` (call only when
    /// [`ClientConn::can_start`]).
    pub fn start(&mut self, job: PeerJob<J>, id: u64, now: Instant) {
        debug_assert!(self.can_start());
        self.out.clear();
        self.out_iovs.clear();
        self.out_first = 0;
        match &job {
            PeerJob::Task(j) => {
                let planned = j.planned();
                let op = j.program().op;
                let spans = j.spans();
                // The body is sent from where it was encoded (it stays
                // untouched until the request is all out: `can_start`).
                wire::encode_request(
                    &mut self.scratch,
                    self.epoch,
                    spans.iter().map(|sp| RemoteDesc { registration: sp.remote_reg, offset: sp.remote, len: sp.len }),
                );
                let (kind, data) = if op == Op::Write { (Kind::Write, planned) } else { (Kind::Read, 0) };
                self.out.extend_from_slice(&wire::encode_header(&wire::header(kind, self.scratch.len(), data, id)));
                self.out_iovs.push(iov(self.out.as_ptr() as u64, self.out.len() as u64));
                self.out_iovs.push(iov(self.scratch.as_ptr() as u64, self.scratch.len() as u64));
                if op == Op::Write {
                    self.out_iovs.extend(spans.iter().map(|sp| iov(sp.local, sp.len)));
                }
            }
            PeerJob::Control(n) => {
                let mut h = wire::header(n.kind, n.body.len(), 0, id);
                h.flags = n.flags;
                self.out.extend_from_slice(&wire::encode_header(&h));
                self.out.extend_from_slice(&n.body);
                self.out_iovs.push(iov(self.out.as_ptr() as u64, self.out.len() as u64));
            }
        }
        self.inflight.push_back((job, id));
        if self.inflight.len() == 1 {
            self.clock.last_io = now; // a wait begins
        }
        self.clock.send_until = self.clock.bounds.until(now, self.send_len());
        self.time_reply(now);
    }

    /// The oldest reply's rate bound starts once its request is all out.
    fn time_reply(&mut self, now: Instant) {
        let sending = self.out_first < self.out_iovs.len();
        let front_out = self.inflight.len() >= 2 || (self.inflight.len() == 1 && !sending);
        if front_out && !self.clock.reply_timed {
            self.clock.reply_timed = true;
            self.clock.reply_until = self.clock.bounds.until(now, self.reply_bytes());
        }
    }

    /// When the peer is lost if nothing moves (`None`: nothing is
    /// awaited).
    pub fn deadline(&self) -> Option<Instant> {
        if self.inflight.is_empty() {
            return None;
        }
        let c = &self.clock;
        let stall = c.last_io.checked_add(c.bounds.stall);
        [stall, c.send_until, c.reply_until].into_iter().flatten().min()
    }

    /// When this idle connection sends its next keepalive (`None`: it is
    /// not idle, or sends none).
    pub fn keepalive_at(&self) -> Option<Instant> {
        let every = self.clock.bounds.keepalive?;
        self.inflight.is_empty().then(|| self.clock.last_io.checked_add(every)).flatten()
    }

    /// Puts a keepalive on the wire if one is due at `now` and the
    /// connection is idle (nothing outstanding, nothing being sent): true
    /// if it did (the connection then has something to send). It has no
    /// reply.
    pub fn keep_alive(&mut self, now: Instant) -> bool {
        if self.keepalive_at().is_none_or(|at| now < at) {
            return false;
        }
        self.clock.last_io = now;
        // Nothing is outstanding (or no keepalive would be due).
        if self.out_first < self.out_iovs.len() {
            return false;
        }
        self.out.clear();
        self.out.extend_from_slice(&wire::encode_header(&wire::header(Kind::Keepalive, 0, 0, 0)));
        self.out_iovs.clear();
        self.out_iovs.push(iov(self.out.as_ptr() as u64, self.out.len() as u64));
        self.out_first = 0;
        true
    }

    /// Why the peer is lost at `now`, if a bound passed.
    pub fn expired(&self, now: Instant) -> Option<Timeout> {
        if self.inflight.is_empty() {
            return None;
        }
        let c = &self.clock;
        if now.duration_since(c.last_io) >= c.bounds.stall {
            return Some(Timeout::Silent(c.bounds.stall));
        }
        if c.send_until.into_iter().chain(c.reply_until).any(|u| now >= u) {
            return Some(Timeout::TooSlow);
        }
        None
    }

    /// Bytes of the request being sent.
    pub fn send_len(&self) -> u64 {
        self.out_iovs[self.out_first.min(self.out_iovs.len())..].iter().map(|v| v.iov_len as u64).sum()
    }

    /// What to send next; `None`: the last request is all out.
    pub fn send_buf(&mut self) -> Option<&mut [libc::iovec]> {
        (self.out_first < self.out_iovs.len()).then(|| &mut self.out_iovs[self.out_first..])
    }

    /// `n` bytes of [`ClientConn::send_buf`] went out, at `now`.
    pub fn sent(&mut self, n: usize, now: Instant) {
        advance(&mut self.out_iovs, &mut self.out_first, n);
        if n > 0 {
            self.clock.last_io = now;
            if self.out_first >= self.out_iovs.len() {
                self.clock.send_until = None;
            }
        }
        self.time_reply(now);
    }

    /// The most bytes the oldest outstanding reply may carry (what the
    /// driver sizes its patience by).
    pub fn reply_bytes(&self) -> u64 {
        match self.inflight.front() {
            Some((PeerJob::Task(j), _)) if j.program().op == Op::Read => j.planned(),
            Some((PeerJob::Task(_), _)) => 0,
            Some((PeerJob::Control(_), _)) => self.limits.max_body as u64,
            None => 0,
        }
    }

    /// Where the next reply bytes go; `None` while nothing is outstanding.
    pub fn recv_buf(&mut self) -> Option<&mut [libc::iovec]> {
        if self.inflight.is_empty() || self.lost.is_some() {
            return None;
        }
        match &self.input {
            Input::Frame => self.frame.target(&mut self.in_iovs),
            Input::Payload { first, .. } => return Some(&mut self.in_iovs[*first..]),
        }
        Some(&mut self.in_iovs[..])
    }

    /// `n` (> 0) reply bytes arrived into what [`ClientConn::recv_buf`]
    /// gave. Returns the job a complete reply completes; `Err` when the
    /// reply broke the protocol (the peer is lost: the job it answered is
    /// in `done`, and [`ClientConn::fail_all`] ends the rest).
    pub fn received(&mut self, n: usize, done: &mut Option<Done<J>>, now: Instant) -> Result<(), Violation> {
        self.clock.last_io = now;
        let result = self.receive(n, done);
        if done.is_some() {
            self.clock.reply_timed = false;
            self.clock.reply_until = None;
        }
        self.time_reply(now);
        result
    }

    fn receive(&mut self, n: usize, done: &mut Option<Done<J>>) -> Result<(), Violation> {
        match &mut self.input {
            Input::Frame => {
                let h = match self.frame.received(n, self.limits) {
                    Ok(Some(h)) => h,
                    Ok(None) => return Ok(()),
                    Err(e) => return self.violation(e, done),
                };
                let id = self.inflight.front().map_or(0, |(_, id)| *id);
                if h.request != id {
                    return self.violation(WireError::WrongRequest { got: h.request, outstanding: id }, done);
                }
                self.on_reply(h, done)
            }
            Input::Payload { first, done: landed } => {
                *landed += n as u64;
                advance(&mut self.in_iovs, first, n);
                if *first < self.in_iovs.len() {
                    return Ok(());
                }
                self.input = Input::Frame;
                if let Some((PeerJob::Task(j), _)) = self.inflight.pop_front() {
                    let planned = j.planned();
                    *done = Some(Done::Task(j, TaskReport { planned, done: planned, end: TaskEnd::Complete }));
                }
                Ok(())
            }
        }
    }

    fn on_reply(&mut self, h: Header, done: &mut Option<Done<J>>) -> Result<(), Violation> {
        self.input = Input::Frame;
        let Some((job, id)) = self.inflight.pop_front() else { return Ok(()) };
        // The reply, decoded once; a control job's answer stays in the
        // frame's body for the job to read.
        let said = Message::decode(&h, self.frame.body()).map(|m| match m {
            Message::Error { status, detail } => Said::Refused(status, detail),
            m => Said::Answer(m.kind()),
        });
        let said = match said {
            Ok(said) => said,
            Err(e) => {
                self.inflight.push_front((job, id));
                return self.violation(e, done);
            }
        };
        match job {
            PeerJob::Task(j) => {
                let planned = j.planned();
                let report = match (j.program().op, said) {
                    // The target validates everything before any byte moves.
                    (_, Said::Refused(status, _)) => {
                        self.lapsed |=
                            matches!(status, RemoteStatus::StaleRegistration | RemoteStatus::UnknownRegistration);
                        TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: false } }
                    }
                    (Op::Write, Said::Answer(Kind::WriteAck)) => {
                        TaskReport { planned, done: planned, end: TaskEnd::Complete }
                    }
                    (Op::Read, Said::Answer(Kind::ReadReply)) if h.data_len as u64 == planned => {
                        self.in_iovs.clear();
                        self.in_iovs.extend(j.spans().iter().map(|sp| iov(sp.local, sp.len)));
                        self.in_iovs.retain(|v| v.iov_len > 0);
                        if self.in_iovs.is_empty() {
                            TaskReport { planned, done: planned, end: TaskEnd::Complete }
                        } else {
                            self.input = Input::Payload { first: 0, done: 0 };
                            self.inflight.push_front((PeerJob::Task(j), id));
                            return Ok(());
                        }
                    }
                    (Op::Read, Said::Answer(Kind::ReadReply)) => {
                        self.inflight.push_front((PeerJob::Task(j), id));
                        let e = WireError::PayloadMismatch { declared: h.data_len, described: planned };
                        return self.violation(e, done);
                    }
                    (_, Said::Answer(k)) => {
                        self.inflight.push_front((PeerJob::Task(j), id));
                        return self.violation(WireError::OutOfPlace(k), done);
                    }
                };
                *done = Some(Done::Task(j, report));
            }
            PeerJob::Control(n) => {
                let result = match said {
                    Said::Answer(k) if k == n.expected_reply() => Ok(self.frame.take_body()),
                    Said::Refused(status, detail) => Err(PeerFailure::Refused(status, detail)),
                    Said::Answer(k) => {
                        self.inflight.push_front((PeerJob::Control(n), id));
                        return self.violation(WireError::OutOfPlace(k), done);
                    }
                };
                *done = Some(Done::Control(n, result));
            }
        }
        Ok(())
    }

    /// The reply to the front job broke the protocol: that job fails as a
    /// lost peer's does.
    fn violation(&mut self, e: WireError, done: &mut Option<Done<J>>) -> Result<(), Violation> {
        let v = Violation(e);
        let why = v.to_string();
        if let Some((job, _)) = self.inflight.pop_front() {
            *done = Some(self.lost_job(job, &why));
        }
        self.lost = Some(why);
        Err(v)
    }

    fn lost_job(&mut self, job: PeerJob<J>, why: &str) -> Done<J> {
        match job {
            PeerJob::Task(j) => {
                let planned = j.planned();
                let report = match (&self.input, j.program().op) {
                    // Exactly what landed locally; a READ has no remote effect.
                    (Input::Payload { done, .. }, Op::Read) => {
                        TaskReport { planned, done: *done, end: TaskEnd::Failed { effect_unknown: false } }
                    }
                    // Some payload may have landed: the effect cannot be known.
                    (_, op) => {
                        TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: op == Op::Write } }
                    }
                };
                self.input = Input::Frame;
                Done::Task(j, report)
            }
            PeerJob::Control(n) => Done::Control(n, Err(PeerFailure::Lost(why.to_owned()))),
        }
    }

    /// The connection failed (`why`): every outstanding job ends, in order.
    pub fn fail_all(&mut self, why: &str) -> Vec<Done<J>> {
        self.lost.get_or_insert_with(|| why.to_owned());
        let c = &mut self.clock;
        (c.send_until, c.reply_timed, c.reply_until) = (None, false, None);
        let mut out = Vec::with_capacity(self.inflight.len());
        while let Some((job, _)) = self.inflight.pop_front() {
            out.push(self.lost_job(job, why));
        }
        self.out_iovs.clear();
        self.out_first = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    //! The machine against a reference model: random jobs (WRITE and READ
    //! tasks, control requests) through a scripted peer that acknowledges,
    //! refuses, answers another request's id or a wrong kind, or goes away
    //! at any byte of a reply; frames cut into random pieces both ways.
    //! Every job completes exactly once, with what the model says.

    use super::*;
    use crate::transport::routes::Mover;
    use crate::transport::{CopyProgram, Span, TaskRange};
    use proptest::prelude::*;
    use std::sync::Arc;

    const EPOCH: u64 = 0xbeef;
    const PATIENT: Bounds = Bounds { stall: Duration::from_secs(3600), min_rate: 0, keepalive: None };
    const LIMITS: Limits = Limits { max_body: 1 << 16, max_data: 1 << 20 };

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

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Answer {
        Ack,
        Refuse,
        WrongId,
        WrongKind,
        /// The connection breaks after this many bytes of the reply.
        Cut(usize),
    }

    #[derive(Debug, Clone)]
    enum Job {
        Write(u64),
        Read(u64),
        Control,
    }

    fn answer() -> impl Strategy<Value = Answer> {
        prop_oneof![
            8 => Just(Answer::Ack),
            2 => Just(Answer::Refuse),
            1 => Just(Answer::WrongId),
            1 => Just(Answer::WrongKind),
            1 => (0usize..200).prop_map(Answer::Cut),
        ]
    }

    fn job() -> impl Strategy<Value = Job> {
        prop_oneof![(1u64..120).prop_map(Job::Write), (1u64..120).prop_map(Job::Read), Just(Job::Control),]
    }

    /// What a job completes with, as the model sees it: (is a task,
    /// bytes done, how it ended or the control result's kind).
    #[derive(Debug, Clone, PartialEq)]
    enum Outcome {
        Task { done: u64, end: TaskEnd },
        Control(Result<Vec<u8>, &'static str>),
    }

    fn outcome(d: &Done<TestJob>) -> (usize, Outcome) {
        match d {
            Done::Task(j, r) => (j.id, Outcome::Task { done: r.done, end: r.end }),
            Done::Control(n, r) => (
                n.flags as usize,
                Outcome::Control(match r {
                    Ok(b) => Ok(b.clone()),
                    Err(PeerFailure::Lost(_)) => Err("lost"),
                    Err(PeerFailure::Refused(..)) => Err("refused"),
                }),
            ),
        }
    }

    /// The model: jobs in order, each with its answer, give these outcomes.
    fn model(jobs: &[(Job, Answer)]) -> Vec<Outcome> {
        let mut out = Vec::new();
        let mut lost_at: Option<usize> = None;
        for (i, (job, answer)) in jobs.iter().enumerate() {
            // Requests already on the wire when the peer was lost (the
            // pipeline holds two) fail as sent; later ones as never sent.
            let o = match lost_at {
                Some(k) => {
                    let sent = i < k + PIPELINE_DEPTH;
                    match job {
                        Job::Write(_) => Outcome::Task { done: 0, end: TaskEnd::Failed { effect_unknown: sent } },
                        Job::Read(_) => Outcome::Task { done: 0, end: TaskEnd::Failed { effect_unknown: false } },
                        Job::Control => Outcome::Control(Err("lost")),
                    }
                }
                None => match (job, answer) {
                    (Job::Write(n), Answer::Ack) | (Job::Read(n), Answer::Ack) => {
                        Outcome::Task { done: *n, end: TaskEnd::Complete }
                    }
                    (Job::Control, Answer::Ack) => Outcome::Control(Ok(b"delta".to_vec())),
                    (Job::Control, Answer::Refuse) => Outcome::Control(Err("refused")),
                    (_, Answer::Refuse) => Outcome::Task { done: 0, end: TaskEnd::Failed { effect_unknown: false } },
                    (j, a) => {
                        lost_at = Some(i);
                        let landed = match (j, a) {
                            (Job::Read(n), Answer::Cut(k)) => {
                                (*k as u64).saturating_sub(wire::HEADER_LEN as u64).min(*n - 1)
                            }
                            _ => 0,
                        };
                        match j {
                            Job::Write(_) => Outcome::Task { done: 0, end: TaskEnd::Failed { effect_unknown: true } },
                            Job::Read(_) => {
                                Outcome::Task { done: landed, end: TaskEnd::Failed { effect_unknown: false } }
                            }
                            Job::Control => Outcome::Control(Err("lost")),
                        }
                    }
                },
            };
            out.push(o);
        }
        out
    }

    /// The reply the scripted peer sends to request `id` of `job`.
    fn reply(job: &Job, answer: Answer, id: u64, data: &[u8]) -> Vec<u8> {
        let frame = |kind: Kind, body: &[u8], data: &[u8], id: u64| {
            let mut f = wire::encode_header(&wire::header(kind, body.len(), data.len() as u64, id)).to_vec();
            f.extend_from_slice(body);
            f.extend_from_slice(data);
            f
        };
        let ok = |id| match job {
            Job::Write(_) => frame(Kind::WriteAck, &[], &[], id),
            Job::Read(n) => frame(Kind::ReadReply, &[], &data[..*n as usize], id),
            Job::Control => frame(Kind::DescribeDelta, b"delta", &[], id),
        };
        match answer {
            Answer::Ack => ok(id),
            Answer::Refuse => {
                let mut body = Vec::new();
                wire::encode_error(&mut body, RemoteStatus::OutOfBounds, "no");
                frame(Kind::Error, &body, &[], id)
            }
            Answer::WrongId => ok(id + 100),
            Answer::WrongKind => frame(Kind::NotifyAck, &[], &[], id).into_iter().chain(ok(id)).collect(),
            // A READ cut inside its payload lands a prefix; cut anywhere
            // else nothing completes.
            Answer::Cut(k) => {
                let full = ok(id);
                let k = match job {
                    Job::Read(n) => k.min(wire::HEADER_LEN + *n as usize - 1),
                    _ => k.min(full.len() - 1),
                };
                full[..k].to_vec()
            }
        }
    }

    /// What a run gives: each completion (job, outcome), each job's local
    /// memory, and the bytes the peer served.
    type Run = (Vec<(usize, Outcome)>, Vec<Vec<u8>>, Vec<u8>);

    fn run(jobs: &[(Job, Answer)], cuts: &[usize]) -> Run {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut locals: Vec<Vec<u8>> = jobs.iter().map(|_| vec![0u8; 128]).collect();
        let mut m: ClientConn<TestJob> = ClientConn::new(EPOCH, LIMITS, PATIENT, std::time::Instant::now());
        let mut cut = cuts.iter().cycle();
        let (mut next, mut done, mut sent_bytes) = (0usize, Vec::new(), Vec::new());
        let mut lost = false;
        let mut answers = std::collections::VecDeque::new();
        loop {
            while m.can_start() && next < jobs.len() {
                let i = next;
                next += 1;
                if lost {
                    let program = Arc::new(CopyProgram {
                        op: Op::Write,
                        mover: Mover::Frames { staging: None },
                        spans: vec![],
                        tasks: vec![],
                    });
                    let pj = match jobs[i].0 {
                        Job::Control => PeerJob::Control(ControlJob {
                            kind: Kind::Notify,
                            flags: i as u8,
                            body: vec![],
                            done: Box::new(|_| {}),
                        }),
                        _ => PeerJob::Task(TestJob {
                            program: program_for(&jobs[i].0, &mut locals[i]).unwrap_or(program),
                            id: i,
                        }),
                    };
                    done.push(outcome(&unsent(pj, "lost".into())));
                    continue;
                }
                let pj = match &jobs[i].0 {
                    Job::Control => PeerJob::Control(ControlJob {
                        kind: Kind::DescribeSince,
                        flags: i as u8,
                        body: b"since".to_vec(),
                        done: Box::new(|_| {}),
                    }),
                    j => PeerJob::Task(TestJob { program: program_for(j, &mut locals[i]).unwrap(), id: i }),
                };
                m.start(pj, i as u64 + 1, std::time::Instant::now());
                while let Some(out) = m.send_buf() {
                    let want = *cut.next().unwrap();
                    let mut n = 0;
                    for v in out.iter() {
                        let k = v.iov_len.min(want - n);
                        // SAFETY: the machine's iovecs address readable memory.
                        sent_bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), k) });
                        n += k;
                        if n == want {
                            break;
                        }
                    }
                    m.sent(n, std::time::Instant::now());
                }
                answers.push_back(reply(&jobs[i].0, jobs[i].1, i as u64 + 1, &data));
            }
            if m.in_flight() == 0 {
                if next >= jobs.len() {
                    break;
                }
                continue;
            }
            // The peer answers the oldest outstanding request.
            let bytes = answers.pop_front().unwrap();
            let (job, answer) = &jobs[next - m.in_flight()];
            let mut at = 0;
            let mut failed = false;
            while at < bytes.len() {
                let Some(into) = m.recv_buf() else { break };
                let want = (*cut.next().unwrap()).min(bytes.len() - at);
                let mut n = 0;
                for v in into.iter() {
                    let k = v.iov_len.min(want - n);
                    // SAFETY: the machine's iovecs address writable memory.
                    unsafe { std::ptr::copy_nonoverlapping(bytes[at + n..].as_ptr(), v.iov_base.cast::<u8>(), k) };
                    n += k;
                    if n == want {
                        break;
                    }
                }
                at += n;
                let mut d = None;
                let r = m.received(n, &mut d, std::time::Instant::now());
                if let Some(d) = d {
                    done.push(outcome(&d));
                }
                if r.is_err() {
                    failed = true;
                    break;
                }
            }
            let _ = job;
            if failed || matches!(answer, Answer::Cut(_)) {
                lost = true;
                done.extend(m.fail_all("lost").iter().map(outcome));
                answers.clear();
            }
        }
        (done, locals, data)
    }

    fn program_for(job: &Job, local: &mut [u8]) -> Option<Arc<CopyProgram>> {
        let (op, n) = match job {
            Job::Write(n) => (Op::Write, *n),
            Job::Read(n) => (Op::Read, *n),
            Job::Control => return None,
        };
        // Two spans, so that a READ lands across them.
        let a = n / 2;
        let base = local.as_mut_ptr() as u64;
        let mut spans = vec![Span { local: base, remote: 0, remote_reg: 1, len: a }];
        spans.push(Span { local: base + a, remote: a, remote_reg: 1, len: n - a });
        spans.retain(|s| s.len > 0);
        let tasks = vec![TaskRange { first_span: 0, end_span: spans.len() as u32, bytes: n }];
        Some(Arc::new(CopyProgram { op, mover: Mover::Frames { staging: None }, spans, tasks }))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn matches_the_model(
            jobs in prop::collection::vec((job(), answer()), 1..16),
            cuts in prop::collection::vec(1usize..64, 1..6),
        ) {
            let expected = model(&jobs);
            let (got, locals, data) = run(&jobs, &cuts);
            let mut ids: Vec<usize> = got.iter().map(|(i, _)| *i).collect();
            ids.sort_unstable();
            prop_assert_eq!(ids, (0..jobs.len()).collect::<Vec<_>>(), "every job completes exactly once");
            for (i, o) in &got {
                prop_assert_eq!(o, &expected[*i], "job {} ({:?})", i, jobs[*i]);
                if let (Job::Read(_), Outcome::Task { done, .. }) = (&jobs[*i].0, o) {
                    prop_assert_eq!(&locals[*i][..*done as usize], &data[..*done as usize], "the prefix landed");
                }
            }
        }
    }
}
