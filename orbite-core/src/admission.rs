//! Admission queue by intent, with anti-starvation and deadlines (sans-IO).
//!
//! Executions that cannot start at once wait here, one FIFO per intent.
//! The highest-priority non-empty class is served first, except that a
//! lower class bypassed `starvation_limit` times in a row is served next.
//! The queue is bounded: a push beyond the bound is refused (the engine
//! turns that into `ResourceExhausted`), never an unbounded allocation.
//! Time is a type parameter: the engine passes `Instant`, tests pass ticks.

use std::collections::VecDeque;

use crate::types::Intent;

/// A waiting item and its deadline.
#[derive(Debug)]
pub struct Queued<T, D> {
    /// The item.
    pub item: T,
    /// When unstarted work of it must be given up.
    pub deadline: Option<D>,
}

/// The bounded, intent-ordered admission queue.
#[derive(Debug)]
pub struct AdmissionQueue<T, D> {
    classes: [VecDeque<Queued<T, D>>; 3],
    skipped: [u32; 3],
    starvation_limit: u32,
    bound: usize,
    with_deadline: usize,
}

impl<T, D: Ord + Copy> AdmissionQueue<T, D> {
    /// An empty queue holding at most `bound` items.
    pub fn new(bound: usize, starvation_limit: u32) -> Self {
        AdmissionQueue {
            classes: Default::default(),
            skipped: [0; 3],
            starvation_limit: starvation_limit.max(1),
            bound,
            with_deadline: 0,
        }
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    /// True if nothing waits.
    pub fn is_empty(&self) -> bool {
        self.classes.iter().all(VecDeque::is_empty)
    }

    /// Appends an item to its class, or gives it back if the queue is full.
    pub fn push(&mut self, intent: Intent, item: T, deadline: Option<D>) -> Result<(), T> {
        if self.len() >= self.bound {
            return Err(item);
        }
        self.with_deadline += deadline.is_some() as usize;
        self.classes[intent as usize].push_back(Queued { item, deadline });
        Ok(())
    }

    /// The class to serve next.
    pub fn next_class(&self) -> Option<Intent> {
        let starving = Intent::ALL
            .into_iter()
            .filter(|c| !self.classes[*c as usize].is_empty() && self.skipped[*c as usize] >= self.starvation_limit)
            .max_by_key(|c| (self.skipped[*c as usize], *c as usize));
        starving.or_else(|| Intent::ALL.into_iter().find(|c| !self.classes[*c as usize].is_empty()))
    }

    /// The head of a class.
    pub fn front(&self, class: Intent) -> Option<&T> {
        self.classes[class as usize].front().map(|q| &q.item)
    }

    /// Records that `class` was served once: waiting lower classes were
    /// bypassed once more.
    pub fn note_served(&mut self, class: Intent) {
        self.skipped[class as usize] = 0;
        for c in Intent::ALL {
            if c > class && !self.classes[c as usize].is_empty() {
                self.skipped[c as usize] += 1;
            }
        }
    }

    /// Removes the head of a class.
    pub fn pop_front(&mut self, class: Intent) -> Option<T> {
        let q = self.classes[class as usize].pop_front()?;
        self.with_deadline -= q.deadline.is_some() as usize;
        if self.classes[class as usize].is_empty() {
            self.skipped[class as usize] = 0;
        }
        Some(q.item)
    }

    /// Removes every item matching `pred`, handing each to `out`.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&T) -> bool, mut out: impl FnMut(T)) {
        for class in Intent::ALL {
            let q = &mut self.classes[class as usize];
            let mut i = 0;
            while i < q.len() {
                if pred(&q[i].item) {
                    if let Some(removed) = q.remove(i) {
                        self.with_deadline -= removed.deadline.is_some() as usize;
                        out(removed.item);
                    }
                } else {
                    i += 1;
                }
            }
            if q.is_empty() {
                self.skipped[class as usize] = 0;
            }
        }
    }

    /// True if some item has a deadline (only then must the clock be read).
    pub fn has_deadlines(&self) -> bool {
        self.with_deadline > 0
    }

    /// The earliest deadline of any waiting item.
    pub fn earliest_deadline(&self) -> Option<D> {
        if self.with_deadline == 0 {
            return None;
        }
        self.classes.iter().flatten().filter_map(|q| q.deadline).min()
    }

    /// Removes every item whose deadline is at or before `now`.
    pub fn take_expired(&mut self, now: D, out: impl FnMut(T)) {
        if self.with_deadline == 0 {
            return;
        }
        let mut expired = Vec::new();
        for class in Intent::ALL {
            for (i, q) in self.classes[class as usize].iter().enumerate() {
                if q.deadline.is_some_and(|d| d <= now) {
                    expired.push((class, i));
                }
            }
        }
        let mut out = out;
        for (class, i) in expired.into_iter().rev() {
            if let Some(q) = self.classes[class as usize].remove(i) {
                self.with_deadline -= 1;
                out(q.item);
            }
        }
        for class in Intent::ALL {
            if self.classes[class as usize].is_empty() {
                self.skipped[class as usize] = 0;
            }
        }
    }

    /// Removes everything (engine close).
    pub fn drain_all(&mut self, mut out: impl FnMut(T)) {
        for class in Intent::ALL {
            for q in self.classes[class as usize].drain(..) {
                out(q.item);
            }
        }
        self.skipped = [0; 3];
        self.with_deadline = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn serve<T>(q: &mut AdmissionQueue<T, u64>) -> Option<T> {
        let c = q.next_class()?;
        q.note_served(c);
        q.pop_front(c)
    }

    #[test]
    fn higher_intent_first_fifo_within_a_class() {
        let mut q = AdmissionQueue::new(10, 100);
        q.push(Intent::Prefetch, 1, None).unwrap();
        q.push(Intent::Normal, 2, None).unwrap();
        q.push(Intent::DecodeCritical, 3, None).unwrap();
        q.push(Intent::Normal, 4, None).unwrap();
        let order: Vec<u32> = std::iter::from_fn(|| serve(&mut q)).collect();
        assert_eq!(order, vec![3, 2, 4, 1]);
    }

    #[test]
    fn bound_refuses_and_gives_the_item_back() {
        let mut q: AdmissionQueue<u32, u64> = AdmissionQueue::new(2, 4);
        q.push(Intent::Normal, 1, None).unwrap();
        q.push(Intent::Normal, 2, None).unwrap();
        assert_eq!(q.push(Intent::DecodeCritical, 3, None), Err(3));
    }

    #[test]
    fn prefetch_is_served_after_the_starvation_limit() {
        let mut q = AdmissionQueue::new(100, 3);
        q.push(Intent::Prefetch, 99, None).unwrap();
        for i in 0..10 {
            q.push(Intent::DecodeCritical, i, None).unwrap();
        }
        let order: Vec<u32> = std::iter::from_fn(|| serve(&mut q)).collect();
        assert_eq!(order, vec![0, 1, 2, 99, 3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn deadlines_expire_only_items_at_or_before_now() {
        let mut q = AdmissionQueue::new(10, 4);
        q.push(Intent::Normal, 1, Some(5)).unwrap();
        q.push(Intent::Normal, 2, None).unwrap();
        q.push(Intent::Prefetch, 3, Some(9)).unwrap();
        assert_eq!(q.earliest_deadline(), Some(5));
        let mut gone = Vec::new();
        q.take_expired(5, |i| gone.push(i));
        assert_eq!(gone, vec![1]);
        assert_eq!(q.earliest_deadline(), Some(9));
        q.take_expired(100, |i| gone.push(i));
        assert_eq!(gone, vec![1, 3]);
        assert!(!q.has_deadlines());
        assert_eq!(q.len(), 1);
    }

    proptest! {
        /// Every pushed item is served exactly once, whatever the interleaving.
        #[test]
        fn no_loss_no_duplication(pushes in prop::collection::vec((0usize..3, any::<bool>()), 1..200), limit in 1u32..6) {
            let mut q: AdmissionQueue<usize, u64> = AdmissionQueue::new(1000, limit);
            let mut served = vec![false; pushes.len()];
            let mut live: Vec<usize> = Vec::new();
            for (id, (class, serve_now)) in pushes.into_iter().enumerate() {
                q.push(Intent::ALL[class], id, None).unwrap();
                live.push(id);
                if serve_now {
                    let s = serve(&mut q).unwrap();
                    prop_assert!(!served[s]);
                    served[s] = true;
                    live.retain(|x| *x != s);
                }
            }
            while let Some(s) = serve(&mut q) {
                prop_assert!(!served[s]);
                served[s] = true;
                live.retain(|x| *x != s);
            }
            prop_assert!(served.iter().all(|s| *s));
            prop_assert!(q.is_empty());
            prop_assert!(live.is_empty());
        }
    }
}
