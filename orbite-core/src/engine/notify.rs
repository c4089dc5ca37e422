//! Notifications: the queue of received ones (charged to
//! `notification_queue_bytes` until taken), the same-host inbox drained
//! into it, and the caller's side of taking and waiting for them.

use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::charge::{Charge, Counter};
use crate::engine::{EngineInner, TransferEngine};
use crate::error::Error;
use crate::memory::HostMemory;
use crate::transport::inbox::Inbox;
use crate::types::Resource;

/// A notification received by this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Endpoint of the sender (empty for an engine without a listener).
    pub sender_endpoint: String,
    /// Epoch of the sender.
    pub sender_epoch: u64,
    /// The payload, byte for byte.
    pub payload: Vec<u8>,
}

pub(crate) type NotificationQueue = Mutex<VecDeque<(Notification, Charge)>>;

/// Bytes a queued notification is charged besides its payload and sender
/// endpoint (its record).
pub(crate) const NOTIFICATION_RECORD: u64 = 128;

/// Longest sender endpoint a notification may carry (a host name of 253
/// bytes and a port fit; anything longer is refused).
pub(crate) const MAX_SENDER_ENDPOINT: usize = 255;

/// Received notifications, waiting to be taken, and the same-host inbox.
#[derive(Default)]
pub(crate) struct Notifications {
    pub queue: NotificationQueue,
    pub arrived: Condvar,
    /// Same-host peers append notifications here (listening engines only).
    pub inbox: OnceLock<(HostMemory, Inbox)>,
    /// When a wait last returned notifications (a monotonic clock's
    /// nanoseconds; 0: never): see [`TransferEngine::wait_notifications`].
    pub last_taken_ns: std::sync::atomic::AtomicU64,
}

/// A wait that follows a notification by less than this polls longer
/// ([`ACTIVE_SPIN_FACTOR`] x `spin_us`) before sleeping.
const ACTIVE_WINDOW: Duration = Duration::from_millis(1);

/// How much longer a wait polls while notifications are flowing. A
/// sleeping waiter is woken in tens of microseconds on a virtual machine;
/// if both sides of an exchange poll for less than that, each side's
/// answer comes only after the other went to sleep, and every round trip
/// then pays two wake-ups (about 110 us here) for as long as the exchange
/// lasts. Polling longer than a wake-up while the exchange is active
/// brings it back after one slow round.
const ACTIVE_SPIN_FACTOR: u32 = 4;

/// Nanoseconds of a process-wide monotonic clock (never 0).
fn mono_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

impl EngineInner {
    /// Queues a received (or self-sent) notification, charged.
    pub(crate) fn enqueue_notification(&self, n: Notification) -> Result<(), Error> {
        let mut q = self.notifications.queue.lock();
        self.check_queue_len(q.len())?;
        let charge = self.charge_notification(&n)?;
        q.push_back((n, charge));
        drop(q);
        self.notifications.arrived.notify_all();
        if let Some((_, inbox)) = self.notifications.inbox.get() {
            inbox.wake(); // waiters sleep on the inbox word when there is one
        }
        Ok(())
    }

    /// Charges a queued notification to `notification_queue_bytes`, whole:
    /// payload, sender endpoint and its record.
    fn charge_notification(&self, n: &Notification) -> Result<Charge, Error> {
        let bytes =
            (n.payload.len() as u64).saturating_add(n.sender_endpoint.len() as u64).saturating_add(NOTIFICATION_RECORD);
        Charge::limited(
            &self.counters,
            Counter::NotificationBytes,
            bytes,
            Resource::NotificationBytes,
            self.config.notification_queue_bytes,
        )
        .map_err(Error::from)
    }

    /// Refuses one more notification when `queued` already fill the queue.
    fn check_queue_len(&self, queued: usize) -> Result<(), Error> {
        let limit = self.config.notification_queue_len;
        if queued as u64 >= limit {
            return Err(Error::ResourceExhausted {
                resource: Resource::NotificationQueue,
                limit,
                requested: limit.saturating_add(1),
            });
        }
        Ok(())
    }

    /// Moves notifications from the same-host inbox into the queue (the
    /// caller holds the queue lock: one consumer). Envelopes that fail the
    /// checks of a TCP delivery are dropped; a full queue leaves the rest in
    /// the inbox, whose senders then fall back to TCP and its refusal.
    pub(crate) fn drain_inbox(&self, q: &mut std::collections::VecDeque<(Notification, Charge)>) {
        let Some((_, inbox)) = self.notifications.inbox.get() else { return };
        if !inbox.has_entries() {
            return;
        }
        let max = self.config.max_notification_bytes as usize;
        let peers = self.peers.latest.lock();
        inbox.drain(max, |env| {
            if env.target_epoch != self.epoch {
                return true; // addressed to another epoch of ours: refused
            }
            let known = peers.get(&env.sender_endpoint).and_then(|w| w.upgrade()).map(|p| p.epoch);
            if known.is_some_and(|e| e != env.sender_epoch) {
                return true; // a stale sender identity: refused
            }
            if env.sender_endpoint.len() > MAX_SENDER_ENDPOINT {
                return true; // malformed: refused
            }
            if self.check_queue_len(q.len()).is_err() {
                return false; // the queue is full: it waits in the inbox
            }
            let n = Notification {
                sender_endpoint: env.sender_endpoint,
                sender_epoch: env.sender_epoch,
                payload: env.payload,
            };
            match self.charge_notification(&n) {
                Ok(charge) => {
                    q.push_back((n, charge));
                    true
                }
                Err(_) => false, // the queue is full: it waits in the inbox
            }
        });
    }
}

impl TransferEngine {
    /// Queues a notification to this engine itself.
    pub fn notify_self(&self, payload: &[u8]) -> Result<(), Error> {
        let inner = self.inner();
        inner.check_notification_size(payload.len())?;
        inner.enqueue_notification(Notification {
            sender_endpoint: inner.own_endpoint(),
            sender_epoch: inner.epoch,
            payload: payload.to_vec(),
        })
    }

    /// Takes every queued notification, oldest first (refunds their charge).
    pub fn take_notifications(&self) -> Vec<Notification> {
        self.wait_notifications(Duration::ZERO)
    }

    /// Takes queued notifications, oldest first, while `fits` accepts the
    /// next one; the first it refuses, and every later one, stay queued.
    /// Lets a caller with a bounded buffer drain without losing any.
    pub fn take_notifications_while(&self, mut fits: impl FnMut(&Notification) -> bool) -> Vec<Notification> {
        let inner = self.inner();
        let taken = {
            let mut q = inner.notifications.queue.lock();
            inner.drain_inbox(&mut q);
            let mut taken = Vec::new();
            while q.front().is_some_and(|(n, _)| fits(n)) {
                taken.extend(q.pop_front());
            }
            taken
        };
        taken.into_iter().map(|(n, _charge)| n).collect()
    }

    /// Like [`Self::take_notifications`], but if none is queued, waits up
    /// to `timeout` for one (polling briefly, then sleeping).
    pub fn wait_notifications(&self, timeout: Duration) -> Vec<Notification> {
        use std::sync::atomic::Ordering;
        let inner = self.inner();
        let deadline = crate::time::deadline_after(timeout);
        let last = inner.notifications.last_taken_ns.load(Ordering::Relaxed);
        let active = last != 0 && mono_ns().saturating_sub(last) < ACTIVE_WINDOW.as_nanos() as u64;
        let spin = if active { inner.config.spin() * ACTIVE_SPIN_FACTOR } else { inner.config.spin() };
        let spin_until = Instant::now() + spin.min(timeout);
        loop {
            // Read the wake-up word before looking, so that an arrival after
            // the look moves it and the sleep below returns at once.
            let seen = inner.notifications.inbox.get().map(|(_, i)| i.word());
            let mut q = inner.notifications.queue.lock();
            inner.drain_inbox(&mut q);
            let now = Instant::now();
            if !q.is_empty() || now >= deadline {
                let taken: Vec<_> = q.drain(..).collect();
                drop(q);
                if !taken.is_empty() {
                    inner.notifications.last_taken_ns.store(mono_ns(), Ordering::Relaxed);
                }
                return taken.into_iter().map(|(n, _charge)| n).collect();
            }
            match (inner.notifications.inbox.get(), seen) {
                (Some((_, inbox)), Some(seen)) => {
                    drop(q);
                    if now < spin_until {
                        while inbox.word() == seen && Instant::now() < spin_until {
                            std::hint::spin_loop();
                        }
                    } else {
                        inbox.sleep(seen, deadline - now);
                    }
                }
                _ => {
                    if now < spin_until {
                        parking_lot::MutexGuard::unlocked(&mut q, std::hint::spin_loop);
                    } else {
                        inner.notifications.arrived.wait_until(&mut q, deadline);
                    }
                }
            }
        }
    }
}
