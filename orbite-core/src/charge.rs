//! Charges: every object the engine keeps is charged to a bounded budget and
//! refunded only when it is destroyed.
//!
//! A charge is an RAII value ([`Charge`]) stored inside the object it pays
//! for, so the refund happens exactly once, when that object is dropped, and
//! never earlier. `stats()` reads the counters; tests assert they come back
//! to baseline after drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::{Exhausted, Resource};

/// The counters of one engine.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub registrations: AtomicU64,
    pub registered_bytes: AtomicU64,
    pub fenced_registrations: AtomicU64,
    pub host_allocations: AtomicU64,
    pub host_memory_bytes: AtomicU64,
    pub prepared_transfers: AtomicU64,
    pub executions: AtomicU64,
    pub queued_executions: AtomicU64,
    pub bytes_in_flight: AtomicU64,
    pub tasks_in_flight: AtomicU64,
    pub unquiesced_owners: AtomicU64,
    pub notification_bytes: AtomicU64,
    pub binding_handles: AtomicU64,
    pub pinned_ranges: AtomicU64,
}

/// Which counter a [`Charge`] pays into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    Registrations,
    RegisteredBytes,
    FencedRegistrations,
    HostAllocations,
    HostMemoryBytes,
    PreparedTransfers,
    Executions,
    QueuedExecutions,
    BytesInFlight,
    TasksInFlight,
    NotificationBytes,
    BindingHandles,
    PinnedRanges,
}

impl Counters {
    fn cell(&self, c: Counter) -> &AtomicU64 {
        match c {
            Counter::Registrations => &self.registrations,
            Counter::RegisteredBytes => &self.registered_bytes,
            Counter::FencedRegistrations => &self.fenced_registrations,
            Counter::HostAllocations => &self.host_allocations,
            Counter::HostMemoryBytes => &self.host_memory_bytes,
            Counter::PreparedTransfers => &self.prepared_transfers,
            Counter::Executions => &self.executions,
            Counter::QueuedExecutions => &self.queued_executions,
            Counter::BytesInFlight => &self.bytes_in_flight,
            Counter::TasksInFlight => &self.tasks_in_flight,
            Counter::NotificationBytes => &self.notification_bytes,
            Counter::BindingHandles => &self.binding_handles,
            Counter::PinnedRanges => &self.pinned_ranges,
        }
    }

    /// Current value of one counter.
    pub fn get(&self, c: Counter) -> u64 {
        self.cell(c).load(Ordering::Acquire)
    }

    /// A snapshot of all counters.
    pub fn snapshot(&self) -> Stats {
        let g = |a: &AtomicU64| a.load(Ordering::Acquire);
        Stats {
            registrations: g(&self.registrations),
            registered_bytes: g(&self.registered_bytes),
            fenced_registrations: g(&self.fenced_registrations),
            host_allocations: g(&self.host_allocations),
            host_memory_bytes: g(&self.host_memory_bytes),
            prepared_transfers: g(&self.prepared_transfers),
            executions: g(&self.executions),
            queued_executions: g(&self.queued_executions),
            bytes_in_flight: g(&self.bytes_in_flight),
            tasks_in_flight: g(&self.tasks_in_flight),
            unquiesced_owners: g(&self.unquiesced_owners),
            notification_bytes: g(&self.notification_bytes),
            binding_handles: g(&self.binding_handles),
            pinned_ranges: g(&self.pinned_ranges),
        }
    }
}

/// One counter to charge: the counter, the amount, and its limit (`None` =
/// unlimited) named by the resource it reports when exceeded.
pub(crate) type ChargeItem = (Counter, u64, Option<(Resource, u64)>);

/// A refund-on-drop charge of `amounts` against shared counters.
#[derive(Debug)]
pub(crate) struct Charge {
    counters: Arc<Counters>,
    amounts: [(Counter, u64); 2],
}

impl Charge {
    /// Charges `amount` to each counter, checking each against its limit
    /// (`None` = unlimited). On failure nothing stays charged.
    pub fn try_new(counters: &Arc<Counters>, items: [ChargeItem; 2]) -> Result<Charge, Exhausted> {
        for (i, &(counter, amount, limit)) in items.iter().enumerate() {
            let cell = counters.cell(counter);
            let mut current = cell.load(Ordering::Relaxed);
            loop {
                let next = current.checked_add(amount);
                let over = match (next, limit) {
                    (None, _) => true,
                    (Some(n), Some((_, max))) => n > max,
                    (Some(_), None) => false,
                };
                if over {
                    // Roll back what this call charged already.
                    for &(c, a, _) in &items[..i] {
                        counters.cell(c).fetch_sub(a, Ordering::AcqRel);
                    }
                    let (resource, max) = limit.unwrap_or((Resource::TransferBytes, u64::MAX));
                    return Err(Exhausted { resource, limit: max, requested: next.unwrap_or(u64::MAX) });
                }
                match cell.compare_exchange_weak(current, current + amount, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => break,
                    Err(seen) => current = seen,
                }
            }
        }
        Ok(Charge { counters: counters.clone(), amounts: [(items[0].0, items[0].1), (items[1].0, items[1].1)] })
    }

    /// One unlimited counter.
    pub fn unlimited(counters: &Arc<Counters>, counter: Counter, amount: u64) -> Charge {
        counters.cell(counter).fetch_add(amount, Ordering::AcqRel);
        Charge { counters: counters.clone(), amounts: [(counter, amount), (counter, 0)] }
    }

    /// One counter with a limit.
    pub fn limited(
        counters: &Arc<Counters>,
        counter: Counter,
        amount: u64,
        resource: Resource,
        limit: u64,
    ) -> Result<Charge, Exhausted> {
        Charge::try_new(counters, [(counter, amount, Some((resource, limit))), (counter, 0, None)])
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        for &(c, a) in &self.amounts {
            if a != 0 {
                self.counters.cell(c).fetch_sub(a, Ordering::AcqRel);
            }
        }
    }
}

/// What the engine holds right now. Every field returns to its baseline
/// once all work has drained and all handles are released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Live registrations (aliases included), deregistered-but-borrowed ones too.
    pub registrations: u64,
    /// Bytes under those registrations.
    pub registered_bytes: u64,
    /// Deregistered registrations still retained by a borrower.
    pub fenced_registrations: u64,
    /// Engine-allocated host memory blocks alive.
    pub host_allocations: u64,
    /// Their bytes.
    pub host_memory_bytes: u64,
    /// Prepared transfers alive (handles, or dropped handles still draining).
    pub prepared_transfers: u64,
    /// Posted executions not yet retired.
    pub executions: u64,
    /// Executions waiting for admission.
    pub queued_executions: u64,
    /// Bytes admitted to routes and not yet retired.
    pub bytes_in_flight: u64,
    /// Route tasks admitted and not yet retired.
    pub tasks_in_flight: u64,
    /// Owners that `close` could not retire and keeps on purpose.
    pub unquiesced_owners: u64,
    /// Bytes of received notifications not yet taken.
    pub notification_bytes: u64,
    /// Handles a binding (the C ABI) holds on this engine's objects.
    pub binding_handles: u64,
    /// Ranges held by [`crate::RangePin`]s (KV sessions pin their KV).
    pub pinned_ranges: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_refunds_exactly_once_on_drop() {
        let c = Arc::new(Counters::default());
        let a = Charge::limited(&c, Counter::Executions, 2, Resource::Executions, 3).unwrap();
        assert_eq!(c.get(Counter::Executions), 2);
        let err = Charge::limited(&c, Counter::Executions, 2, Resource::Executions, 3).unwrap_err();
        assert!(matches!(err, Exhausted { resource: Resource::Executions, limit: 3, requested: 4 }));
        assert_eq!(c.get(Counter::Executions), 2, "a refused charge leaves nothing");
        drop(a);
        assert_eq!(c.get(Counter::Executions), 0);
    }

    #[test]
    fn two_counter_charge_rolls_back_the_first_when_the_second_fails() {
        let c = Arc::new(Counters::default());
        let err = Charge::try_new(
            &c,
            [
                (Counter::Registrations, 1, Some((Resource::Registrations, 10))),
                (Counter::RegisteredBytes, 100, Some((Resource::RegisteredBytes, 50))),
            ],
        )
        .unwrap_err();
        assert!(matches!(err, Exhausted { resource: Resource::RegisteredBytes, .. }));
        assert_eq!(c.snapshot(), Stats::default());
    }
}
