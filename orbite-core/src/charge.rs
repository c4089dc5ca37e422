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

/// Defines, from one list of counters (doc, field and variant of each), the
/// [`Counters`] atomics, the [`Counter`] that names one of them, the mapping
/// between the two, and the public [`Stats`] with its field list.
macro_rules! counters {
    ($($(#[doc = $doc:literal])+ $field:ident: $variant:ident,)+) => {
        /// The counters of one engine.
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub $field: AtomicU64,)+
        }

        /// Which counter a [`Charge`] pays into.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[allow(dead_code, reason = "one variant per counter: `stats()` fills unquiesced_owners, nothing charges it; the CUDA counters only with feature `cuda`")]
        pub(crate) enum Counter {
            $($variant,)+
        }

        #[cfg(test)]
        impl Counter {
            /// Every counter, in the order of the list.
            const ALL: [Counter; Stats::FIELDS.len()] = [$(Counter::$variant,)+];
        }

        impl Counters {
            fn cell(&self, c: Counter) -> &AtomicU64 {
                match c {
                    $(Counter::$variant => &self.$field,)+
                }
            }

            /// A snapshot of all counters.
            pub fn snapshot(&self) -> Stats {
                Stats { $($field: self.$field.load(Ordering::Acquire),)+ }
            }
        }

        /// What the engine holds right now. Every field returns to its baseline
        /// once all work has drained, all handles are released and peers are
        /// gone, except `auth_failures` and `connections_refused`, counts.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct Stats {
            $($(#[doc = $doc])+ pub $field: u64,)+
        }

        impl Stats {
            /// The names of the fields, in their order.
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field),)+];

            /// Every field with its name, in their order.
            pub fn fields(&self) -> [(&'static str, u64); Stats::FIELDS.len()] {
                [$((stringify!($field), self.$field),)+]
            }
        }
    };
}

counters! {
    /// Live registrations (aliases included), deregistered-but-borrowed ones too.
    registrations: Registrations,
    /// Bytes under those registrations.
    registered_bytes: RegisteredBytes,
    /// Deregistered registrations still retained by a borrower.
    fenced_registrations: FencedRegistrations,
    /// Engine-allocated host memory blocks alive.
    host_allocations: HostAllocations,
    /// Their bytes.
    host_memory_bytes: HostMemoryBytes,
    /// Prepared transfers alive (handles, or dropped handles still draining).
    prepared_transfers: PreparedTransfers,
    /// Posted executions not yet retired.
    executions: Executions,
    /// Executions waiting for admission.
    queued_executions: QueuedExecutions,
    /// Bytes admitted to routes and not yet retired.
    bytes_in_flight: BytesInFlight,
    /// Route tasks admitted and not yet retired.
    tasks_in_flight: TasksInFlight,
    /// Owners that `close` could not retire and keeps on purpose.
    unquiesced_owners: UnquiescedOwners,
    /// Bytes of received notifications not yet taken.
    notification_bytes: NotificationBytes,
    /// Handles a binding (the C ABI) holds on this engine's objects.
    binding_handles: BindingHandles,
    /// Ranges held by [`crate::RangePin`]s (KV sessions pin their KV).
    pinned_ranges: PinnedRanges,
    /// Peer connections that failed authentication, either way (a count:
    /// the one field that only grows).
    auth_failures: AuthFailures,
    /// Engine-allocated CUDA device memory blocks alive (feature `cuda`).
    device_allocations: DeviceAllocations,
    /// Their bytes.
    device_memory_bytes: DeviceMemoryBytes,
    /// Pinned host buffers of the engine's staging pools alive (feature
    /// `cuda`).
    staging_buffers: StagingBuffers,
    /// Their bytes.
    staging_bytes: StagingBytes,
    /// Peers' CUDA IPC allocations imported and not yet closed.
    cuda_imports: CudaImports,
    /// Peer connections this engine's listener holds (authenticated or
    /// not, tcp and local socket).
    connections: Connections,
    /// Peer connections closed at accept because a cap was full
    /// (`max_connections`, `max_connections_per_address`,
    /// `max_unauthenticated_connections`): a count, it only grows.
    connections_refused: ConnectionsRefused,
    /// Bytes of frame and reply buffers the listener's connections hold
    /// beyond their small resting size (`max_frame_buffer_bytes`).
    frame_buffer_bytes: FrameBufferBytes,
    /// Borrows peers hold on this engine's registrations (`max_borrows`).
    borrows: Borrows,
    /// Bytes of the bookkeeping of those borrows (`max_borrow_bytes`).
    borrow_bytes: BorrowBytes,
    /// Peers subscribed to this engine's registration changes
    /// (`max_watchers`).
    watchers: Watchers,
}

impl Counters {
    /// Current value of one counter.
    pub fn get(&self, c: Counter) -> u64 {
        self.cell(c).load(Ordering::Acquire)
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

    #[test]
    fn each_counter_maps_to_its_own_field_in_list_order() {
        let c = Arc::new(Counters::default());
        let charges: Vec<Charge> =
            Counter::ALL.into_iter().zip(1..).map(|(counter, amount)| Charge::unlimited(&c, counter, amount)).collect();
        let s = c.snapshot();
        let fields = s.fields();
        assert_eq!(fields.map(|(name, _)| name).as_slice(), Stats::FIELDS);
        assert_eq!(fields.map(|(_, v)| v), std::array::from_fn(|i| i as u64 + 1), "{s:?}");
        assert_eq!((s.registrations, s.executions, s.pinned_ranges), (1, 7, 14));
        drop(charges);
        assert_eq!(c.snapshot(), Stats::default());
    }
}
