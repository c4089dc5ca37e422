//! Segments: what one engine exposes to peers, and the lease a peer holds
//! on what it imported.
//!
//! The [`SegmentDescriptor`] (endpoint, epoch, and per registration its id,
//! generation, bounds, kind and permission) is a bounded, versioned byte
//! string, exchanged out of band (NIXL carries it as connection info and
//! public metadata) or fetched with a Describe request. The Describe reply
//! is authoritative: `open_segment` checks the epoch it reports.
//!
//! Registrations made (or removed) after a peer opened this engine reach it
//! as a [`Delta`]: what changed since the registry version its view has,
//! in pages that fit one frame. A [`SegmentView`] is an initiator's current
//! picture of a peer: by id, and by address for range lookups.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::codec::{Reader, Short};
use crate::memory::MemoryKind;
use crate::registry::Registration;
use crate::types::{Permission, RegistrationId};
use crate::wire::{self, WireError};

/// Version of the descriptor encoding.
pub const DESCRIPTOR_VERSION: u16 = 6;
const ENTRY_FIXED: usize = 40;
const HEADER_FIXED: usize = 2 + 2 + 4 + 8 + 8 + 16 + 2;

/// One exported registration.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExportedRegistration {
    /// Id (index and generation) at the exporting engine.
    pub id: RegistrationId,
    /// Length in bytes.
    pub len: u64,
    /// What peers may do with it.
    pub permission: Permission,
    /// Its address in the exporting process (for CMA on the same host).
    pub addr: u64,
    /// For a range of a shared allocation: the allocation's name and
    /// the range's offset in it.
    pub shm: Option<(String, u64)>,
    /// For CUDA device memory: its CUDA ordinal at the exporting engine.
    /// Peers reach it only over tcp, where the exporting engine stages it
    /// (never by CMA or a mapping: its address is a device address).
    pub device: Option<u32>,
    /// The rkey of its memory region on each RDMA NIC of the exporting
    /// engine, by the NIC's index (`None`: no region there). Carried only
    /// to authenticated peers: [`SegmentDescriptor::without_keys`] clears
    /// them from a descriptor handed out of band.
    pub rkeys: Vec<Option<u32>>,
}

impl ExportedRegistration {
    /// A registration of this engine, as peers see it.
    pub(crate) fn of(r: &Registration) -> Self {
        ExportedRegistration {
            id: r.id,
            len: r.len,
            permission: r.permission,
            addr: r.base as u64,
            shm: match &r.kind {
                MemoryKind::Shm { name, offset } => Some((name.to_string(), *offset)),
                MemoryKind::Host | MemoryKind::Cuda { .. } => None,
            },
            device: match r.kind {
                MemoryKind::Cuda { device } => Some(device),
                _ => None,
            },
            rkeys: r.rdma.rkeys(),
        }
    }
}

/// What an engine exposes to peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// Where the engine listens (`host:port`).
    pub endpoint: String,
    /// The engine's identity for this run.
    pub epoch: u64,
    /// The registry version this list is a snapshot of (refreshes ask for
    /// what changed after it).
    pub registry_version: u64,
    /// The engine's process id (for CMA).
    pub pid: u32,
    /// How many RDMA NICs the engine uses (0: none): registrations list an
    /// rkey per NIC, and a peer with NICs of its own connects to them.
    pub rdma_nics: u8,
    /// The kernel's boot id (all zero if unknown): same-host routes need
    /// both sides to report the same nonzero one.
    pub boot_id: [u8; 16],
    /// The name of the engine's notification inbox, a shared allocation
    /// (empty: none).
    pub inbox: String,
    /// The engine's local socket (an abstract Unix socket name; empty:
    /// none): a peer on the same host proves over it which process it
    /// reaches (`transport::unix`).
    pub local_socket: String,
    /// Registrations peers may target.
    pub registrations: Vec<ExportedRegistration>,
}

fn perm_code(p: Permission) -> u8 {
    match p {
        Permission::LocalOnly => 0,
        Permission::RemoteRead => 1,
        Permission::RemoteReadWrite => 2,
    }
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`), or zeros.
pub fn local_boot_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    let mut out = [0u8; 16];
    if hex.len() != 32 {
        return out;
    }
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        let v = std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok());
        match v {
            Some(v) => out[i] = v,
            None => return [0u8; 16],
        }
    }
    out
}

/// A short read or a bad field, of a descriptor or of a delta: both
/// report it as a malformed "segment descriptor".
fn short(_: Short) -> WireError {
    WireError::Malformed("segment descriptor")
}

fn read_str<'a>(r: &mut Reader<'a>, n: usize) -> Result<&'a str, Short> {
    std::str::from_utf8(r.take(n)?).map_err(|_| Short)
}

/// `count` registration entries; the count is bounded by the bytes left
/// before anything is allocated. A bad entry is a [`Short`] too.
fn read_entries(r: &mut Reader<'_>, count: usize) -> Result<Vec<ExportedRegistration>, Short> {
    if count > r.remaining() / ENTRY_FIXED {
        return Err(Short);
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let (id, len, addr, offset) = (RegistrationId::from_raw(r.u64()?), r.u64()?, r.u64()?, r.u64()?);
        let [permission, shared, n0, n1, kind, ordinal, keys, _] = r.array::<8>()?;
        let permission = match permission {
            0 => Permission::LocalOnly,
            1 => Permission::RemoteRead,
            2 => Permission::RemoteReadWrite,
            _ => return Err(Short),
        };
        let shared = match shared {
            0 => false,
            1 => true,
            _ => return Err(Short),
        };
        let name = read_str(r, u16::from_le_bytes([n0, n1]) as usize)?;
        if shared == name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(Short);
        }
        // A range that wraps the address space is never a registration.
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Short);
        }
        let shm = shared.then(|| (name.to_owned(), offset));
        // Memory kind (descriptor byte 4; 0 in descriptors of engines
        // without device memory): 0 host, 1 CUDA device memory of the
        // ordinal in byte 5, never shared.
        let device = match (kind, ordinal, shared) {
            (0, 0, _) => None,
            (1, d, false) => Some(d as u32),
            _ => return Err(Short),
        };
        // An rkey per NIC of the exporter: a flag (1: a region there),
        // then the key (0 without one).
        let mut rkeys = Vec::with_capacity(keys as usize);
        for _ in 0..keys {
            let [flag, k0, k1, k2, k3] = r.array::<5>()?;
            let key = u32::from_le_bytes([k0, k1, k2, k3]);
            rkeys.push(match (flag, key) {
                (1, key) => Some(key),
                (0, 0) => None,
                _ => return Err(Short),
            });
        }
        out.push(ExportedRegistration { rkeys, id, len, permission, addr, shm, device });
    }
    Ok(out)
}

fn encode_entry(out: &mut Vec<u8>, r: &ExportedRegistration) {
    let (name, offset) = r.shm.as_ref().map_or(("", 0), |(n, o)| (n.as_str(), *o));
    out.extend_from_slice(&r.id.to_raw().to_le_bytes());
    out.extend_from_slice(&r.len.to_le_bytes());
    out.extend_from_slice(&r.addr.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.push(perm_code(r.permission));
    out.push(r.shm.is_some() as u8);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    // A device ordinal above 255 is exported as host-unreachable memory of
    // device 255 (never addressed by CMA or a mapping either way).
    let keys = r.rkeys.len().min(u8::MAX as usize);
    match r.device {
        Some(d) => out.extend_from_slice(&[1, d.min(255) as u8, keys as u8, 0]),
        None => out.extend_from_slice(&[0, 0, keys as u8, 0]),
    }
    out.extend_from_slice(name.as_bytes());
    for k in &r.rkeys[..keys] {
        out.push(k.is_some() as u8);
        out.extend_from_slice(&k.unwrap_or(0).to_le_bytes());
    }
}

/// Encoded size of one registration entry.
pub fn entry_len(r: &ExportedRegistration) -> usize {
    ENTRY_FIXED + r.shm.as_ref().map_or(0, |(n, _)| n.len()) + 5 * r.rkeys.len().min(u8::MAX as usize)
}

/// Bytes before the lists of an encoded [`Delta`].
pub const DELTA_HEADER: usize = 24;
const DELTA_RESET: u32 = 1;
const DELTA_MORE: u32 = 2;

/// What changed in a peer's exported registrations after a registry
/// version (a reply to a delta refresh).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    /// The version the view reaches by applying this page.
    pub version: u64,
    /// The view must be cleared first: `added` starts the whole list.
    pub reset: bool,
    /// More changes follow: ask again from `version`.
    pub more: bool,
    /// Raw ids no longer registered.
    pub removed: Vec<u64>,
    /// Registrations added (and still live).
    pub added: Vec<ExportedRegistration>,
}

impl Delta {
    /// Encodes the delta.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(DELTA_HEADER + 8 * self.removed.len() + self.added.iter().map(entry_len).sum::<usize>());
        let flags = if self.reset { DELTA_RESET } else { 0 } | if self.more { DELTA_MORE } else { 0 };
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&(self.removed.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.added.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for raw in &self.removed {
            out.extend_from_slice(&raw.to_le_bytes());
        }
        for r in &self.added {
            encode_entry(&mut out, r);
        }
        out
    }

    /// Decodes a delta; the layout must be exact.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let bad = WireError::Malformed("segment delta");
        let mut r = Reader::new(b);
        let (version, flags) = (r.u64().map_err(short)?, r.u32().map_err(short)?);
        if flags & !(DELTA_RESET | DELTA_MORE) != 0 {
            return Err(bad);
        }
        let (removed_count, added_count, _) =
            (r.u32().map_err(short)?, r.u32().map_err(short)?, r.u32().map_err(short)?);
        if removed_count as usize > r.remaining() / 8 {
            return Err(bad);
        }
        let removed = (0..removed_count).map(|_| r.u64()).collect::<Result<_, _>>().map_err(short)?;
        let added = read_entries(&mut r, added_count as usize).map_err(short)?;
        if !r.is_empty() {
            return Err(bad);
        }
        Ok(Delta { version, reset: flags & DELTA_RESET != 0, more: flags & DELTA_MORE != 0, removed, added })
    }
}

/// An initiator's current picture of a peer's registrations.
#[derive(Debug, Clone, Default)]
pub struct SegmentView {
    /// The peer's registry version this view reflects.
    pub version: u64,
    regs: HashMap<u64, ExportedRegistration>,
    /// (address, raw id) of every registration, ordered: range lookups,
    /// and changes applied one key at a time (pushed changes are small).
    by_addr: BTreeSet<(u64, u64)>,
    /// Most registrations this view holds (0: no bound): a peer cannot make
    /// it grow without end.
    limit: usize,
}

/// How far back a range lookup walks before it scans everything (overlaps
/// are rare: registrations of one peer seldom nest).
const NEAREST_CANDIDATES: usize = 64;

impl SegmentView {
    /// The view of a descriptor.
    pub fn of(d: &SegmentDescriptor) -> Self {
        let mut v = SegmentView { version: d.registry_version, ..SegmentView::default() };
        v.regs.reserve(d.registrations.len());
        for r in &d.registrations {
            v.insert(r.clone());
        }
        v
    }

    /// The view of a descriptor that never holds more than `limit`
    /// registrations (0: no bound); a descriptor with more is refused, and
    /// so are changes that would exceed it.
    pub fn bounded(d: &SegmentDescriptor, limit: usize) -> Result<Self, WireError> {
        let mut v = Self::of(d);
        if limit > 0 && v.len() > limit {
            return Err(WireError::TooLong { what: "peer registrations", len: v.len() as u64, limit: limit as u64 });
        }
        v.limit = limit;
        Ok(v)
    }

    /// How many registrations this view would hold after `d` (applied as
    /// `apply_from` does: removals, then additions, ids counted once).
    fn len_after(&self, d: &Delta) -> usize {
        let held = |raw: &u64| !d.reset && self.regs.contains_key(raw);
        let gone: HashSet<u64> = d.removed.iter().copied().filter(held).collect();
        let kept = if d.reset { 0 } else { self.len() - gone.len() };
        let fresh: HashSet<u64> =
            d.added.iter().map(|r| r.id.to_raw()).filter(|raw| !held(raw) || gone.contains(raw)).collect();
        kept + fresh.len()
    }

    /// Applies one page of changes computed from this view's version.
    pub fn apply(&mut self, d: Delta) -> Result<(), WireError> {
        self.apply_from(self.version, d).map(drop)
    }

    /// Applies changes computed from registry version `base` (what
    /// changed after it, up to `d.version`). Any base at or below this
    /// view's version gives the right state: additions still live and
    /// removals are both idempotent. A base above it would leave a gap and
    /// is refused; changes older than the view are ignored (`Ok(false)`).
    pub fn apply_from(&mut self, base: u64, d: Delta) -> Result<bool, WireError> {
        if d.reset {
            if d.version < self.version {
                return Ok(false);
            }
        } else if base > self.version {
            return Err(WireError::Malformed("segment delta does not continue the view"));
        } else if d.version < self.version {
            return Ok(false);
        }
        // Checked before anything changes: a refused page leaves the view
        // as it was. Removals of ids the view does not hold make no room.
        if self.limit > 0 {
            let after = self.len_after(&d);
            if after > self.limit {
                return Err(WireError::TooLong {
                    what: "peer registrations",
                    len: after as u64,
                    limit: self.limit as u64,
                });
            }
        }
        if d.reset {
            self.regs.clear();
            self.by_addr.clear();
        }
        for raw in d.removed {
            if let Some(old) = self.regs.remove(&raw) {
                self.by_addr.remove(&(old.addr, raw));
            }
        }
        self.regs.reserve(d.added.len());
        for r in d.added {
            self.insert(r);
        }
        self.version = d.version;
        Ok(true)
    }

    fn insert(&mut self, r: ExportedRegistration) {
        let key = (r.addr, r.id.to_raw());
        if let Some(old) = self.regs.insert(key.1, r) {
            self.by_addr.remove(&(old.addr, key.1));
        }
        self.by_addr.insert(key);
    }

    /// A registration by raw id.
    pub fn get(&self, raw: u64) -> Option<&ExportedRegistration> {
        self.regs.get(&raw)
    }

    /// The registrations, by raw id.
    pub fn registrations(&self) -> &HashMap<u64, ExportedRegistration> {
        &self.regs
    }

    /// Number of registrations.
    pub fn len(&self) -> usize {
        self.regs.len()
    }

    /// True without registrations.
    pub fn is_empty(&self) -> bool {
        self.regs.is_empty()
    }

    /// A registration covering `[addr, addr + len)` that `accept`s, the
    /// one starting nearest below `addr` first.
    pub fn find_range(
        &self,
        addr: u64,
        len: u64,
        accept: impl Fn(&ExportedRegistration) -> bool,
    ) -> Option<&ExportedRegistration> {
        let end = addr.checked_add(len)?;
        let covers = |r: &&ExportedRegistration| r.addr <= addr && r.addr + r.len >= end && accept(r);
        let mut near = self.by_addr.range(..=(addr, u64::MAX)).rev().filter_map(|(_, raw)| self.regs.get(raw));
        if let Some(r) = near.by_ref().take(NEAREST_CANDIDATES).find(covers) {
            return Some(r);
        }
        near.find(covers)
    }
}

impl SegmentDescriptor {
    /// Encodes the descriptor.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(HEADER_FIXED + self.endpoint.len() + 4 + self.registrations.len() * ENTRY_FIXED);
        out.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        out.extend_from_slice(&[self.rdma_nics, 0]);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.registry_version.to_le_bytes());
        out.extend_from_slice(&self.boot_id);
        for s in [&self.endpoint, &self.inbox, &self.local_socket] {
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        out.extend_from_slice(&(self.registrations.len() as u32).to_le_bytes());
        for r in &self.registrations {
            encode_entry(&mut out, r);
        }
        out
    }

    /// Decodes a descriptor of at most `max_len` bytes; the layout must be
    /// exact.
    pub fn decode(b: &[u8], max_len: usize) -> Result<Self, WireError> {
        if b.len() > max_len {
            return Err(WireError::TooLong { what: "segment descriptor", len: b.len() as u64, limit: max_len as u64 });
        }
        wire::exact(b, "segment descriptor", |r| {
            let (version, [rdma_nics, reserved]) = (r.u16()?, r.array()?);
            if version != DESCRIPTOR_VERSION || reserved != 0 {
                return Err(Short);
            }
            let (pid, epoch, registry_version, boot_id) = (r.u32()?, r.u64()?, r.u64()?, r.array()?);
            let mut string = || -> Result<String, Short> {
                let n = r.u16()? as usize;
                Ok(read_str(r, n)?.to_owned())
            };
            let (endpoint, inbox, local_socket) = (string()?, string()?, string()?);
            if inbox.contains('/') || inbox.starts_with('.') {
                return Err(Short);
            }
            let count = r.u32()? as usize;
            let registrations = read_entries(r, count)?;
            Ok(SegmentDescriptor {
                rdma_nics,
                endpoint,
                epoch,
                registry_version,
                pid,
                boot_id,
                inbox,
                local_socket,
                registrations,
            })
        })
    }

    /// The descriptor with no rkey: the form handed out of band (to
    /// anyone), where only an authenticated peer's Describe gets keys.
    pub fn without_keys(mut self) -> Self {
        for r in &mut self.registrations {
            r.rkeys.clear();
        }
        self
    }

    /// True if both descriptors come from one boot of one machine.
    pub fn same_boot(&self, boot_id: &[u8; 16]) -> bool {
        self.boot_id != [0u8; 16] && &self.boot_id == boot_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SegmentDescriptor {
        SegmentDescriptor {
            rdma_nics: 0,
            endpoint: "127.0.0.1:4000".into(),
            epoch: 0xDEAD_BEEF,
            registry_version: 17,
            pid: 42,
            boot_id: [7; 16],
            inbox: "orbite-inbox-1".into(),
            local_socket: "orbite-00000000deadbeef".into(),
            registrations: vec![
                ExportedRegistration {
                    rkeys: Vec::new(),
                    id: RegistrationId::from_raw(7 | (3 << 32)),
                    len: 4096,
                    permission: Permission::RemoteRead,
                    addr: 0x7000_0000,
                    shm: Some(("orbite-1-2-3".into(), 8192)),
                    device: None,
                },
                ExportedRegistration {
                    rkeys: Vec::new(),
                    id: RegistrationId::from_raw(1),
                    len: 1,
                    permission: Permission::RemoteReadWrite,
                    addr: 1,
                    shm: None,
                    device: None,
                },
            ],
        }
    }

    #[test]
    fn descriptor_round_trip_and_exact_layout() {
        let d = sample();
        let b = d.to_bytes();
        assert_eq!(SegmentDescriptor::decode(&b, 1 << 20).unwrap(), d);
        assert!(SegmentDescriptor::decode(&b[..b.len() - 1], 1 << 20).is_err());
        let mut longer = b.clone();
        longer.push(0);
        assert!(SegmentDescriptor::decode(&longer, 1 << 20).is_err());
        assert!(matches!(SegmentDescriptor::decode(&b, 10), Err(WireError::TooLong { .. })));
        // A shared-memory name that looks like a path is refused.
        let mut evil = d.clone();
        evil.registrations[0].shm = Some(("../etc/passwd".into(), 0));
        assert!(SegmentDescriptor::decode(&evil.to_bytes(), 1 << 20).is_err());
    }

    /// Rkeys, one per NIC of the exporter, round-trip exactly; a flag
    /// that is neither 0 nor 1, or a key without a region, is refused; and
    /// the form handed out of band carries none.
    #[test]
    fn rkeys_travel_per_nic_and_stay_out_of_the_public_form() {
        let mut d = sample();
        d.rdma_nics = 2;
        d.registrations[1].rkeys = vec![Some(0xAABB_CCDD), None];
        let b = d.to_bytes();
        assert_eq!(SegmentDescriptor::decode(&b, 1 << 20).unwrap(), d);
        // The last entry ends with its two keys: flag and key each.
        let keys = b.len() - 10;
        assert_eq!(&b[keys..], &[1, 0xDD, 0xCC, 0xBB, 0xAA, 0, 0, 0, 0, 0]);
        for (at, v) in [(keys, 2u8), (keys + 5, 1), (keys + 6, 1)] {
            let mut bad = b.clone();
            bad[at] = v;
            let r = SegmentDescriptor::decode(&bad, 1 << 20);
            if (at, v) == (keys + 5, 1) {
                assert_eq!(r.unwrap().registrations[1].rkeys, [Some(0xAABB_CCDD), Some(0)], "a region with key 0");
            } else {
                assert!(r.is_err(), "byte {at} = {v}");
            }
        }
        let public = d.clone().without_keys();
        assert!(public.registrations.iter().all(|r| r.rkeys.is_empty()));
        assert_eq!(public.rdma_nics, 2);
        assert!(public.to_bytes().len() < b.len());
        let mut reserved = b.clone();
        reserved[3] = 1;
        assert!(SegmentDescriptor::decode(&reserved, 1 << 20).is_err(), "the reserved header byte");
    }

    #[test]
    fn device_memory_is_marked_in_the_descriptor_and_checked_on_decode() {
        let mut d = sample();
        d.registrations[1].device = Some(3);
        let b = d.to_bytes();
        assert_eq!(SegmentDescriptor::decode(&b, 1 << 20).unwrap(), d);
        // The kind byte of the second entry (after its id, len, addr,
        // offset, permission, shared flag and name length).
        let at = b.len() - ENTRY_FIXED + 8 * 4 + 4;
        assert_eq!((b[at], b[at + 1]), (1, 3));
        let mut unknown = b.clone();
        unknown[at] = 2;
        assert!(SegmentDescriptor::decode(&unknown, 1 << 20).is_err(), "an unknown memory kind");
        let mut host_ordinal = b.clone();
        host_ordinal[at] = 0;
        assert!(SegmentDescriptor::decode(&host_ordinal, 1 << 20).is_err(), "host memory with an ordinal");
        let mut shared_device = d.clone();
        shared_device.registrations[0].device = Some(0);
        assert!(SegmentDescriptor::decode(&shared_device.to_bytes(), 1 << 20).is_err(), "shared device memory");
    }

    #[test]
    fn delta_round_trip_exact_layout_and_view_updates() {
        let d = sample();
        let mut view = SegmentView::of(&d);
        assert_eq!((view.version, view.len()), (17, 2));
        let added = ExportedRegistration {
            rkeys: Vec::new(),
            id: RegistrationId::from_raw(9),
            len: 100,
            permission: Permission::RemoteRead,
            addr: 0x7000_0000 + 10,
            shm: None,
            device: None,
        };
        let delta =
            Delta { version: 19, reset: false, more: false, removed: vec![7 | (3 << 32)], added: vec![added.clone()] };
        let b = delta.to_bytes();
        assert_eq!(Delta::decode(&b).unwrap(), delta);
        assert!(Delta::decode(&b[..b.len() - 1]).is_err());
        let mut longer = b.clone();
        longer.push(0);
        assert!(Delta::decode(&longer).is_err());
        view.apply(delta).unwrap();
        assert_eq!(view.version, 19);
        assert!(view.get(7 | (3 << 32)).is_none(), "removed");
        assert_eq!(view.find_range(0x7000_0000 + 20, 10, |_| true), Some(&added));
        assert_eq!(view.find_range(0x7000_0000 + 20, 100, |_| true), None, "beyond its end");
        assert_eq!(view.find_range(0x7000_0000 + 20, 10, |r| r.permission.remote_write()), None);
        let older = Delta { version: 3, added: vec![added.clone()], ..Delta::default() };
        assert_eq!(view.apply_from(1, older), Ok(false), "older changes are ignored");
        assert_eq!(view.version, 19);
        let gap = Delta { version: 25, ..Delta::default() };
        assert!(view.apply_from(20, gap).is_err(), "a gap is refused");
        let mut small = SegmentView::bounded(&d, 3).unwrap();
        let two = Delta {
            version: 30,
            added: vec![
                added.clone(),
                ExportedRegistration { rkeys: Vec::new(), id: RegistrationId::from_raw(99), ..added.clone() },
            ],
            ..Delta::default()
        };
        assert!(
            matches!(small.apply(two.clone()), Err(WireError::TooLong { .. })),
            "a bounded view refuses to grow past its limit"
        );
        // Found by the `segment` fuzz target: removals of ids the view
        // never held made room; a refused reset page emptied the view; a
        // descriptor beyond the bound was taken whole.
        let phantom = Delta { removed: vec![1234, 5678], ..two.clone() };
        assert!(matches!(small.apply(phantom), Err(WireError::TooLong { .. })), "phantom removals make no room");
        assert_eq!(small.len(), d.registrations.len(), "refused pages change nothing");
        let three: Vec<ExportedRegistration> = (0..3)
            .map(|i| ExportedRegistration { rkeys: Vec::new(), id: RegistrationId::from_raw(500 + i), ..added.clone() })
            .collect();
        let mut one = SegmentView::bounded(&d, 2).unwrap();
        let kept = one.len();
        assert!(one.apply(Delta { version: 40, reset: true, added: three, ..Delta::default() }).is_err());
        assert_eq!(one.len(), kept, "a refused reset leaves the view as it was");
        assert!(SegmentView::bounded(&d, 1).is_err(), "a descriptor beyond the bound");
        view.apply(Delta { version: 30, reset: true, ..Delta::default() }).unwrap();
        assert!(view.is_empty());
    }

    proptest::proptest! {
        /// The view's id map and address index agree with a plain model
        /// after any sequence of pages: lookups find exactly what a scan
        /// of the model finds.
        #[test]
        fn view_matches_a_model(pages in proptest::collection::vec(
            (proptest::collection::vec(0u64..40, 0..8), proptest::collection::vec((0u64..40, 0u64..64, 1u64..8), 0..8)),
            1..12,
        ), probes in proptest::collection::vec((0u64..80, 1u64..6), 1..30)) {
            let mut model: std::collections::HashMap<u64, (u64, u64)> = Default::default();
            let mut view = SegmentView::default();
            for (version, (removed, added)) in pages.into_iter().enumerate() {
                let added: Vec<ExportedRegistration> = added
                    .into_iter()
                    .map(|(raw, addr, len)| ExportedRegistration { rkeys: Vec::new(),
                        id: RegistrationId::from_raw(raw),
                        len,
                        permission: Permission::RemoteRead,
                        addr,
                        shm: None,
                        device: None,
                    })
                    .collect();
                for raw in &removed {
                    model.remove(raw);
                }
                for r in &added {
                    model.insert(r.id.to_raw(), (r.addr, r.len));
                }
                view.apply(Delta { version: version as u64 + 1, reset: false, more: false, removed, added }).unwrap();
            }
            proptest::prop_assert_eq!(view.len(), model.len());
            for (raw, (addr, len)) in &model {
                let r = view.get(*raw).unwrap();
                proptest::prop_assert_eq!((r.addr, r.len), (*addr, *len));
            }
            for (addr, len) in probes {
                let found = view.find_range(addr, len, |_| true).map(|r| r.id.to_raw());
                let any = model.iter().any(|(_, (a, l))| *a <= addr && a + l >= addr + len);
                proptest::prop_assert_eq!(found.is_some(), any);
                if let Some(raw) = found {
                    let (a, l) = model[&raw];
                    proptest::prop_assert!(a <= addr && a + l >= addr + len);
                }
            }
        }
    }

    #[test]
    fn boot_id_is_read_and_compared() {
        let id = local_boot_id();
        let mut d = sample();
        d.boot_id = id;
        assert_eq!(d.same_boot(&id), id != [0u8; 16]);
        d.boot_id = [0; 16];
        assert!(!d.same_boot(&[0; 16]), "an unknown boot never matches");
    }
}
