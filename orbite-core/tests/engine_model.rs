//! Property test: random sequences of prepare, post, check, cancel,
//! release, drop, deregister, register and (withheld) completion or fault,
//! run against the real engine and a reference model. After every step the
//! engine's charges and every live transfer's status must match the model.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::*;
use orbite_core::fault::FaultDirective;
use orbite_core::*;
use proptest::prelude::*;

const SLOTS: usize = 4;
const MAX_TASKS: usize = 2;
const QUEUE: usize = 3;

#[derive(Debug, Clone)]
enum Step {
    Prepare(usize),
    Post(usize),
    Check(usize),
    Cancel(usize),
    Release(usize),
    Drop(usize),
    Deregister(usize),
    Register(usize),
    Complete { fail: bool, unknown: bool },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..SLOTS).prop_map(Step::Prepare),
        4 => (0..SLOTS).prop_map(Step::Post),
        1 => (0..SLOTS).prop_map(Step::Check),
        2 => (0..SLOTS).prop_map(Step::Cancel),
        2 => (0..SLOTS).prop_map(Step::Release),
        1 => (0..SLOTS).prop_map(Step::Drop),
        1 => (0..2usize).prop_map(Step::Deregister),
        1 => (0..2usize).prop_map(Step::Register),
        4 => (any::<bool>(), any::<bool>()).prop_map(|(fail, unknown)| Step::Complete { fail, unknown }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Exec {
    None,
    Queued,
    Held,
    Done(OutcomeCode),
}

impl Exec {
    fn active(self) -> bool {
        matches!(self, Exec::Queued | Exec::Held)
    }
}

/// A transfer of the model: `key` identifies it in queue and held lists.
#[derive(Debug, Clone)]
struct MTransfer {
    key: usize,
    instance: usize,
    exec: Exec,
}

struct Instance {
    id: RegistrationId,
    live: bool,
}

struct World {
    e: TransferEngine,
    src: Region,
    dst: [HostMemory; 2],
    instances: Vec<Instance>,
    current: [Option<usize>; 2],
    slots: Vec<Option<(MTransfer, Transfer)>>,
    orphans: Vec<MTransfer>,
    queue: VecDeque<usize>,
    held: VecDeque<usize>,
    next_key: usize,
}

impl World {
    fn new() -> World {
        let e = engine(&format!(
            // One worker: held tasks are then held in admission order.
            r#"{{"max_tasks_in_flight": {MAX_TASKS}, "admission_queue_len": {QUEUE}, "max_executions": 100, "local_route_workers": 1}}"#
        ));
        e.fault_hooks().hold_all(true);
        let src = region(&e, 8192, Permission::RemoteReadWrite);
        let dst = [e.allocate_host_memory(8192).unwrap(), e.allocate_host_memory(8192).unwrap()];
        let mut w = World {
            e,
            src,
            dst,
            instances: Vec::new(),
            current: [None, None],
            slots: (0..SLOTS).map(|_| None).collect(),
            orphans: Vec::new(),
            queue: VecDeque::new(),
            held: VecDeque::new(),
            next_key: 0,
        };
        w.register(0);
        w.register(1);
        w
    }

    fn register(&mut self, d: usize) {
        let r = MemoryRange::host(&self.dst[d], 0, 8192, Permission::RemoteReadWrite).unwrap();
        let id = self.e.register_memory_ranges(vec![r]).unwrap()[0];
        self.instances.push(Instance { id, live: true });
        self.current[d] = Some(self.instances.len() - 1);
    }

    fn all_transfers(&self) -> impl Iterator<Item = &MTransfer> {
        self.slots.iter().flatten().map(|(m, _)| m).chain(self.orphans.iter())
    }

    fn find_mut(&mut self, key: usize) -> &mut MTransfer {
        if let Some(i) = self.orphans.iter().position(|m| m.key == key) {
            return &mut self.orphans[i];
        }
        self.slots.iter_mut().flatten().map(|(m, _)| m).find(|m| m.key == key).expect("key exists")
    }

    fn admit(&mut self) {
        while self.held.len() < MAX_TASKS {
            let Some(k) = self.queue.pop_front() else { break };
            self.find_mut(k).exec = Exec::Held;
            self.held.push_back(k);
        }
    }

    fn expected_stats(&self) -> Stats {
        let alive = |m: &&MTransfer| m.exec.active() || self.slots.iter().flatten().any(|(s, _)| s.key == m.key);
        let borrowed: Vec<usize> = self.all_transfers().filter(alive).map(|m| m.instance).collect();
        let fenced =
            (0..self.instances.len()).filter(|i| !self.instances[*i].live && borrowed.contains(i)).count() as u64;
        let live = self.instances.iter().filter(|i| i.live).count() as u64;
        let active = self.all_transfers().filter(|m| m.exec.active()).count() as u64;
        Stats {
            registrations: 1 + live + fenced,
            registered_bytes: 8192 * (1 + live + fenced),
            fenced_registrations: fenced,
            host_allocations: 3,
            host_memory_bytes: 3 * 8192,
            prepared_transfers: self.all_transfers().filter(alive).count() as u64,
            executions: active,
            queued_executions: self.queue.len() as u64,
            bytes_in_flight: 1024 * self.held.len() as u64,
            tasks_in_flight: self.held.len() as u64,
            unquiesced_owners: 0,
            notification_bytes: 0,
            binding_handles: 0,
            pinned_ranges: 0,
            auth_failures: 0,
            device_allocations: 0,
            device_memory_bytes: 0,
            staging_buffers: 0,
            staging_bytes: 0,
            cuda_imports: 0,
            connections: 0,
            connections_refused: 0,
            frame_buffer_bytes: 0,
            borrows: 0,
            borrow_bytes: 0,
            watchers: 0,
        }
    }

    fn settle(&self) -> Result<(), TestCaseError> {
        let want = self.expected_stats();
        let start = Instant::now();
        loop {
            let got = self.e.stats();
            if got == want && self.e.fault_hooks().held().len() == self.held.len() {
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(TestCaseError::fail(format!(
                    "stats never matched the model:\n got {got:?}\nwant {want:?}"
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        for (m, t) in self.slots.iter().flatten() {
            let s = t.status();
            let ok = match (m.exec, s) {
                (Exec::None, TransferStatus::NotPosted) => true,
                (Exec::Queued, TransferStatus::InProgress { phase: ExecutionPhase::Queued, .. }) => true,
                (Exec::Held, TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. }) => true,
                (Exec::Done(code), TransferStatus::Retired(r)) => r.outcome.code == code,
                _ => false,
            };
            prop_assert!(ok, "transfer {} model {:?} engine {:?}", m.key, m.exec, s);
        }
        Ok(())
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Prepare(k) => {
                if self.slots[k].is_some() {
                    return Ok(());
                }
                let d = k % 2;
                let inst = self.current[d];
                let dst_id = inst.map(|i| self.instances[i].id).unwrap_or(self.instances[0].id);
                let l = [Desc::new(self.src.id, k as u64 * 1024, 1024)];
                let r = [Desc::new(dst_id, k as u64 * 1024, 1024)];
                let got = self.e.prepare(&spec(Op::Write, &l, &r));
                match inst.filter(|i| self.instances[*i].live) {
                    Some(i) => {
                        let t = got.map_err(|e| TestCaseError::fail(format!("prepare failed: {e}")))?;
                        let m = MTransfer { key: self.next_key, instance: i, exec: Exec::None };
                        self.next_key += 1;
                        self.slots[k] = Some((m, t));
                    }
                    None => prop_assert!(matches!(got, Err(Error::Registry(RegistryError::Stale(_))))),
                }
            }
            Step::Post(k) => {
                let Some((m, t)) = &self.slots[k] else { return Ok(()) };
                let got = t.post();
                let key = m.key;
                match m.exec {
                    e if e.active() => {
                        prop_assert!(matches!(got, Err(Error::Batch(BatchError::ExecutionActive { .. }))), "{:?}", got)
                    }
                    Exec::Done(c) if c != OutcomeCode::Success => {
                        prop_assert!(matches!(got, Err(Error::Batch(BatchError::RepostRefused { .. }))), "{:?}", got)
                    }
                    _ if !self.instances[m.instance].live => {
                        prop_assert!(matches!(got, Err(Error::Registry(RegistryError::Deregistered(_)))))
                    }
                    _ if self.queue.len() >= QUEUE => prop_assert!(
                        matches!(got, Err(Error::ResourceExhausted { resource: Resource::AdmissionQueue, .. })),
                        "{:?}",
                        got
                    ),
                    _ => {
                        prop_assert!(got.is_ok(), "post failed: {:?}", got);
                        self.find_mut(key).exec = Exec::Queued;
                        self.queue.push_back(key);
                        self.admit();
                    }
                }
            }
            Step::Check(k) => {
                if let Some((_, t)) = &self.slots[k] {
                    let _ = t.check();
                }
            }
            Step::Cancel(k) => {
                let Some((m, t)) = &self.slots[k] else { return Ok(()) };
                let got = t.cancel();
                let key = m.key;
                match m.exec {
                    Exec::None => prop_assert!(matches!(got, Err(Error::Batch(BatchError::NotPosted)))),
                    Exec::Queued => {
                        prop_assert!(got.is_ok());
                        self.queue.retain(|q| *q != key);
                        self.find_mut(key).exec = Exec::Done(OutcomeCode::Cancelled);
                    }
                    _ => prop_assert!(got.is_ok()),
                }
            }
            Step::Release(k) => {
                let Some((m, t)) = self.slots[k].take() else { return Ok(()) };
                match t.release() {
                    Ok(()) => prop_assert!(!m.exec.active(), "release of active work succeeded"),
                    Err(refused) => {
                        prop_assert!(m.exec.active(), "release refused: {}", refused.error);
                        self.slots[k] = Some((m, refused.transfer));
                    }
                }
            }
            Step::Drop(k) => {
                let Some((m, t)) = self.slots[k].take() else { return Ok(()) };
                drop(t);
                if m.exec.active() {
                    self.orphans.push(m);
                }
            }
            Step::Deregister(d) => match self.current[d].filter(|i| self.instances[*i].live) {
                Some(i) => {
                    self.e.deregister(self.instances[i].id).unwrap();
                    self.instances[i].live = false;
                }
                None => {
                    let stale = self.current[d].map(|i| self.instances[i].id).unwrap();
                    prop_assert!(matches!(self.e.deregister(stale), Err(Error::Registry(RegistryError::Stale(_)))));
                }
            },
            Step::Register(d) => {
                if !self.current[d].is_some_and(|i| self.instances[i].live) {
                    self.register(d);
                }
            }
            Step::Complete { fail, unknown } => {
                let Some(key) = self.held.pop_front() else { return Ok(()) };
                let tickets = self.e.fault_hooks().held();
                let directive =
                    if fail { FaultDirective::Fail { bytes: 0, effect_unknown: unknown } } else { FaultDirective::Run };
                prop_assert!(self.e.fault_hooks().release(tickets[0], directive));
                let code = if fail { OutcomeCode::Failed } else { OutcomeCode::Success };
                self.find_mut(key).exec = Exec::Done(code);
                self.orphans.retain(|m| m.exec.active());
                self.admit();
            }
        }
        self.orphans.retain(|m| m.exec.active());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn engine_matches_reference_model(steps in prop::collection::vec(step(), 1..48)) {
        let mut w = World::new();
        for s in &steps {
            w.apply(s)?;
            w.settle()?;
        }
        // Drain: complete everything, release everything; back to baseline.
        w.e.fault_hooks().hold_all(false);
        w.e.fault_hooks().release_all();
        prop_assert!(w.e.wait_idle(WAIT));
        for (_, t) in w.slots.drain(..).flatten() {
            prop_assert!(t.release().is_ok());
        }
        let s = w.e.stats();
        let live = w.instances.iter().filter(|i| i.live).count() as u64;
        prop_assert_eq!((s.prepared_transfers, s.executions, s.fenced_registrations, s.registrations), (0, 0, 0, 1 + live));
    }
}
