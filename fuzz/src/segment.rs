//! The segment descriptor and its deltas: `SegmentDescriptor::decode`,
//! `Delta::decode`, and an initiator's `SegmentView` fed with both, as a
//! peer's Describe and DescribeDelta replies feed it.
//!
//! Input: one byte of options (the view's bound), a length-prefixed
//! descriptor, then operations: apply a length-prefixed delta from some
//! base version, or look a range up. The view is checked against a plain
//! map that follows the rules `SegmentView::apply_from` documents.

use std::collections::HashMap;

use orbite_core::segment::{Delta, ExportedRegistration, SegmentDescriptor, SegmentView};
use orbite_core::{MemoryRange, Permission, TransferEngine};

use crate::input::{Input, Seed};

/// Bounds a view may have (0: none).
const VIEW_LIMITS: [usize; 4] = [0, 1, 4, 64];

/// The view as `apply_from` documents it.
struct Model {
    version: u64,
    regs: HashMap<u64, ExportedRegistration>,
    limit: usize,
}

impl Model {
    fn apply_from(&mut self, base: u64, d: &Delta) -> Result<bool, ()> {
        if d.reset {
            if d.version < self.version {
                return Ok(false);
            }
        } else if base > self.version {
            return Err(());
        } else if d.version < self.version {
            return Ok(false);
        }
        // The page as a whole: refused (changing nothing) when what it
        // leaves is over the bound.
        let mut next = if d.reset { HashMap::new() } else { self.regs.clone() };
        for raw in &d.removed {
            next.remove(raw);
        }
        for r in &d.added {
            next.insert(r.id.to_raw(), r.clone());
        }
        if self.limit > 0 && next.len() > self.limit {
            return Err(());
        }
        self.regs = next;
        self.version = d.version;
        Ok(true)
    }
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let limit = VIEW_LIMITS[input.u8() as usize % VIEW_LIMITS.len()];
    let desc = input.chunk(usize::MAX);
    crate::wire::check_descriptor(desc);
    let (mut view, mut model) = match SegmentDescriptor::decode(desc, 1 << 20) {
        Ok(d) => {
            let mut regs = HashMap::new();
            for r in &d.registrations {
                regs.insert(r.id.to_raw(), r.clone());
            }
            match SegmentView::bounded(&d, limit) {
                Ok(view) => {
                    assert_eq!(view.version, d.registry_version);
                    assert!(limit == 0 || view.len() <= limit, "a view holds no more than its bound");
                    (view, Model { version: d.registry_version, regs, limit })
                }
                Err(_) => {
                    assert!(limit > 0 && regs.len() > limit, "a descriptor within the bound is refused");
                    (SegmentView::default(), Model { version: 0, regs: HashMap::new(), limit: 0 })
                }
            }
        }
        Err(_) => (SegmentView::default(), Model { version: 0, regs: HashMap::new(), limit: 0 }),
    };
    while !input.is_empty() {
        match input.u8() % 3 {
            0 => {
                let base = match input.u8() % 3 {
                    0 => view.version,
                    1 => 0,
                    _ => input.u64(),
                };
                let bytes = input.chunk(usize::MAX);
                crate::wire::check_delta(bytes);
                let Ok(d) = Delta::decode(bytes) else { continue };
                // The bound the view was made with (none when the
                // descriptor did not decode or was refused).
                let bound = model.limit;
                let within = bound == 0 || view.len() <= bound;
                let expected = model.apply_from(base, &d);
                crate::trace(format_args!(
                    "apply base {base} version {} reset {} removed {} added {} to a view of {} at {} (limit {limit})",
                    d.version,
                    d.reset,
                    d.removed.len(),
                    d.added.len(),
                    view.len(),
                    view.version
                ));
                let got = view.apply_from(base, d);
                crate::trace(format_args!("-> {got:?}, view holds {}", view.len()));
                assert_eq!(got.is_ok(), expected.is_ok(), "apply_from accepts what its rules accept");
                if let (Ok(g), Ok(e)) = (&got, &expected) {
                    assert_eq!(g, e, "apply_from applies what its rules apply");
                }
                assert_eq!(view.version, model.version, "the view's version");
                assert_eq!(view.registrations(), &model.regs, "a refused page changes nothing");
                if within && bound > 0 {
                    assert!(view.len() <= bound, "a view never grows past its bound");
                }
            }
            1 => {
                let (addr, len) = (input.u64(), input.u64() % (1 << 20));
                let found = view.find_range(addr, len, |_| true);
                let end = addr.checked_add(len);
                let covers = |r: &ExportedRegistration| end.is_some_and(|end| r.addr <= addr && r.addr + r.len >= end);
                if let Some(r) = found {
                    assert!(covers(r), "find_range returns a registration that covers the range");
                }
                assert_eq!(found.is_some(), model.regs.values().any(covers), "find_range finds one if any covers");
            }
            _ => {
                let raw = input.u64();
                assert_eq!(view.get(raw), model.regs.get(&raw), "get agrees with the model");
            }
        }
        assert_eq!(view.registrations(), &model.regs, "the view holds what its rules say");
        assert_eq!(view.len(), view.registrations().len());
    }
}

/// A descriptor of a real engine with host and shared registrations, as
/// `segment_descriptor` encodes it (`None` if the engine cannot start here).
pub fn sample_descriptor() -> Option<Vec<u8>> {
    let engine = TransferEngine::from_json("{}").ok()?;
    let host = engine.allocate_host_memory(1 << 16).ok()?;
    let mut ranges = vec![
        MemoryRange::host(&host, 0, 4096, Permission::RemoteReadWrite).ok()?,
        MemoryRange::host(&host, 8192, 4096, Permission::RemoteRead).ok()?,
        MemoryRange::host(&host, 0, 1 << 16, Permission::LocalOnly).ok()?,
    ];
    if let Ok(shm) = engine.allocate_shm_memory(1 << 16) {
        ranges.push(MemoryRange::host(&shm, 4096, 4096, Permission::RemoteReadWrite).ok()?);
    }
    engine.register_memory_ranges(ranges).ok()?;
    // As an authenticated peer's Describe has it: two RDMA NICs, a region
    // on the first for every registration, on the second for some.
    let mut d = engine.segment_descriptor();
    d.rdma_nics = 2;
    for (i, r) in d.registrations.iter_mut().enumerate() {
        r.rkeys = vec![Some(0x1100 + i as u32), (i % 2 == 0).then_some(0x2200 + i as u32)];
    }
    Some(d.to_bytes())
}

/// Deltas of the sample descriptor's registrations: removals, additions,
/// a reset page.
fn sample_deltas(desc: &SegmentDescriptor) -> Vec<Delta> {
    let v = desc.registry_version;
    let ids: Vec<u64> = desc.registrations.iter().map(|r| r.id.to_raw()).collect();
    vec![
        Delta { version: v + 1, removed: ids[..1].to_vec(), ..Delta::default() },
        Delta { version: v + 2, added: desc.registrations[..1].to_vec(), more: true, ..Delta::default() },
        Delta { version: v + 3, reset: true, added: desc.registrations.clone(), ..Delta::default() },
    ]
}

pub fn seeds() -> Vec<Vec<u8>> {
    let Some(bytes) = sample_descriptor() else { return Vec::new() };
    let desc = SegmentDescriptor::decode(&bytes, 1 << 20).expect("an engine's own descriptor decodes");
    let first = desc.registrations.first().map_or((0, 0), |r| (r.addr, r.len));
    let mut seeds = Vec::new();
    for limit in [0u8, 2] {
        let mut s = Seed::new();
        s.u8(limit).chunk(&bytes);
        for d in sample_deltas(&desc) {
            s.u8(0).u8(0).chunk(&d.to_bytes());
        }
        s.u8(1).u64(first.0 + 1).u64(first.1 - 1);
        s.u8(2).u64(desc.registrations.first().map_or(0, |r| r.id.to_raw()));
        seeds.push(s.done());
    }
    // A delta from the future, and one on an empty view.
    let mut s = Seed::new();
    s.u8(0).chunk(&[]).u8(0).u8(2).u64(u64::MAX).chunk(&sample_deltas(&desc)[0].to_bytes());
    seeds.push(s.done());
    seeds
}
