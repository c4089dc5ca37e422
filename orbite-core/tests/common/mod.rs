//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use orbite_core::*;

pub const WAIT: Duration = Duration::from_secs(20);

/// SplitMix64: a small deterministic generator for layouts and patterns.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

pub fn engine(json: &str) -> TransferEngine {
    TransferEngine::from_json(json).expect("engine config")
}

/// A host memory block with one registration over all of it.
pub struct Region {
    pub mem: HostMemory,
    pub id: RegistrationId,
}

pub fn region(engine: &TransferEngine, len: usize, perm: Permission) -> Region {
    let mem = engine.allocate_host_memory(len).unwrap();
    let id = engine.register_memory_ranges(vec![MemoryRange::host(&mem, 0, len, perm).unwrap()]).unwrap()[0];
    Region { mem, id }
}

pub fn fill(mem: &HostMemory, seed: u64) {
    let mut rng = Rng(seed);
    let mut bytes = vec![0u8; mem.len()];
    for chunk in bytes.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    // SAFETY: no transfer is active on this memory while tests fill it.
    unsafe { mem.write(0, &bytes) };
}

pub fn snapshot(mem: &HostMemory) -> Vec<u8> {
    let mut out = vec![0u8; mem.len()];
    // SAFETY: callers snapshot only when no transfer writes this memory.
    unsafe { mem.read(0, &mut out) };
    out
}

/// Non-overlapping ranges of `region_len` whose lengths sum to `total`,
/// with gaps (guard bytes) between them, in random order of placement.
pub fn layout(rng: &mut Rng, total: u64, max_frag: u64, region_len: u64) -> Vec<(u64, u64)> {
    let mut lens = Vec::new();
    let mut left = total;
    while left > 0 {
        let l = rng.range(1, max_frag.min(left));
        lens.push(l);
        left -= l;
    }
    let slack = region_len - total;
    let gaps_total = slack.min(lens.len() as u64 * 64);
    let mut offsets = Vec::with_capacity(lens.len());
    let mut pos = 0u64;
    for l in &lens {
        pos += rng.below(gaps_total / lens.len() as u64 + 1) + 1; // odd offsets happen
        offsets.push((pos, *l));
        pos += l;
    }
    assert!(pos <= region_len, "layout does not fit");
    // Shuffle the order in which ranges appear in the list.
    for i in (1..offsets.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        offsets.swap(i, j);
    }
    offsets
}

/// Ranges `(offset, len)` of one region.
pub type Layout = Vec<(u64, u64)>;

/// A random total in `lo..=hi` and two independent layouts of it (local and
/// remote), fragments up to `max_frag` bytes, in regions of `region` bytes.
pub fn paired_layouts(rng: &mut Rng, lo: u64, hi: u64, max_frag: u64, region: u64) -> (u64, Layout, Layout) {
    let total = rng.range(lo, hi);
    let frag = rng.range(1, max_frag);
    let local = layout(rng, total, frag, region);
    let frag = rng.range(1, max_frag);
    let remote = layout(rng, total, frag, region);
    (total, local, remote)
}

pub fn descs(id: RegistrationId, ranges: &[(u64, u64)]) -> Vec<Desc> {
    ranges.iter().map(|&(o, l)| Desc::new(id, o, l)).collect()
}

/// What `dst` must hold after copying the `src` ranges (as one stream) into
/// the `dst` ranges (as one stream); every other byte keeps its value.
pub fn expected(src: &[u8], src_ranges: &[(u64, u64)], dst: &[u8], dst_ranges: &[(u64, u64)]) -> Vec<u8> {
    let stream: Vec<u8> =
        src_ranges.iter().flat_map(|&(o, l)| src[o as usize..(o + l) as usize].iter().copied()).collect();
    let mut out = dst.to_vec();
    let mut at = 0usize;
    for &(o, l) in dst_ranges {
        out[o as usize..(o + l) as usize].copy_from_slice(&stream[at..at + l as usize]);
        at += l as usize;
    }
    assert_eq!(at, stream.len());
    out
}

pub fn spec<'a>(op: Op, local: &'a [Desc], remote: &'a [Desc]) -> TransferSpec<'a> {
    TransferSpec::new(op, local, remote, Target::Loopback)
}

pub fn wait_retired(t: &Transfer) -> TransferResult {
    match t.wait(WAIT) {
        TransferStatus::Retired(r) => r,
        other => panic!("transfer did not retire: {other:?}"),
    }
}

/// Everything but host memory and registrations the test still holds.
pub fn assert_idle(engine: &TransferEngine) {
    assert!(engine.wait_idle(WAIT), "engine did not drain");
    let s = engine.stats();
    assert_eq!((s.executions, s.queued_executions, s.bytes_in_flight, s.tasks_in_flight), (0, 0, 0, 0), "{s:?}");
}

/// FNV-1a over bytes: a digest both processes can compute.
pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Reads one frame from a raw peer connection: its header and body.
pub fn read_frame(s: &mut std::net::TcpStream) -> (wire::Header, Vec<u8>) {
    use std::io::Read;
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 1 << 30 }).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    (h, body)
}

/// The status and detail of an Error frame's body.
pub fn refusal(body: &[u8]) -> (wire::RemoteStatus, String) {
    match wire::Message::decode(&wire::header(wire::Kind::Error, body.len(), 0, 0), body) {
        Ok(wire::Message::Error { status, detail }) => (status, detail),
        other => panic!("not an error body: {other:?}"),
    }
}

/// The target epoch, version and reply bound of a Watch frame's body.
pub fn watch_of(body: &[u8]) -> (u64, u64, u64) {
    match wire::Message::decode(&wire::header(wire::Kind::Watch, body.len(), 0, 0), body) {
        Ok(wire::Message::Watch { target_epoch, since, max_reply }) => (target_epoch, since, max_reply),
        other => panic!("not a watch body: {other:?}"),
    }
}

/// The target epoch, base version and delta of a Changed frame's body.
pub fn changed_of(body: &[u8]) -> (u64, u64, &[u8]) {
    match wire::Message::decode(&wire::header(wire::Kind::Changed, body.len(), 0, 0), body) {
        Ok(wire::Message::Changed { target_epoch, base, delta }) => (target_epoch, base, delta),
        other => panic!("not a changed body: {other:?}"),
    }
}
