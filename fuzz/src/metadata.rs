//! The NIXL plugin's metadata blobs: peer information (its connection
//! info, `getConnInfo` / `loadRemoteConnInfo`) and range metadata (its
//! public data, `getPublicData` / `loadRemoteMD`). The plugin passes both to
//! the C ABI (`orbite_peer_open`, `orbite_peer_import_range`), whose Rust
//! side parses them; the plugin also reads the epoch out of peer
//! information itself (`peerEpoch`).
//!
//! Input: one byte of options, then the blob. The options can patch the
//! blob's epoch (and a range's address) to this process's engine, so that
//! accepted blobs reach the lookups behind the parsers. Checks: what a
//! parser accepts encodes back to the same bytes; the C ABI refuses exactly
//! what the parser refuses, with the same status; the plugin reads the
//! same epoch the ABI does. `orbite_peer_open` is only called where it
//! cannot dial anything (the self peer, an empty endpoint, a refused blob).

use std::sync::OnceLock;

use orbite_nixl::fuzzing::{decode_peer_info, decode_range_info, encode_peer_info, encode_range_info};
use orbite_nixl::*;

use crate::abi::{buffer_out, engine_options};
use crate::input::{Input, Seed};
use crate::plugin::{self, Outcome};

/// This process's engine: two registrations over a static buffer, and its
/// self peer.
struct Local {
    engine: OrbiteEngine,
    peer: OrbitePeer,
    epoch: u64,
    /// (address, length) of each registration.
    ranges: Vec<(u64, u64)>,
    /// Each registration's exported metadata.
    exports: Vec<Vec<u8>>,
}

fn local() -> &'static Local {
    static LOCAL: OnceLock<Local> = OnceLock::new();
    LOCAL.get_or_init(|| {
        let json = r#"{"local_route_workers": 1}"#;
        let mut engine = OrbiteEngine::default();
        // SAFETY: the options point at `json`, alive for the call; `engine`
        // is a live local.
        let s = unsafe { orbite_engine_create(&engine_options(json), &mut engine) };
        assert_eq!(s, OrbiteStatus::Ok, "an engine starts");
        // Memory that lives as long as the process: the registrations are
        // never given up.
        let memory: &'static mut [u8] = Box::leak(vec![0u8; 1 << 16].into_boxed_slice());
        let base = memory.as_mut_ptr() as u64;
        let ranges = vec![(base, 4096), (base + 8192, 1 << 12)];
        let mut exports = Vec::new();
        for (i, &(addr, len)) in ranges.iter().enumerate() {
            let region = OrbiteMemRegion {
                size: size_of::<OrbiteMemRegion>() as u32,
                version: ORBITE_RECORD_VERSION,
                addr,
                len,
                kind: ORBITE_MEM_DRAM,
                device: 0,
                permission: if i == 0 { ORBITE_PERM_REMOTE_READ_WRITE } else { ORBITE_PERM_REMOTE_READ },
                reserved: 0,
                release: None,
                release_context: std::ptr::null_mut(),
            };
            let mut reg = OrbiteRegistration::default();
            // SAFETY: the range lies in the leaked buffer, valid for the
            // rest of the process; `region` and `reg` are live locals.
            assert_eq!(unsafe { orbite_mem_register(engine, &region, &mut reg) }, OrbiteStatus::Ok);
            // SAFETY: buffer_out passes a live buffer of the length it gives.
            let export = buffer_out(|b, c, n| unsafe { orbite_mem_export(reg, b, c, n) }).expect("an export");
            exports.push(export);
        }
        // SAFETY: as above.
        let info = buffer_out(|b, c, n| unsafe { orbite_engine_export_peer(engine, b, c, n) }).expect("peer info");
        let (epoch, _) = decode_peer_info(&info).expect("an engine's own peer information decodes");
        let mut peer = OrbitePeer::default();
        // SAFETY: `info` is readable for its length, `peer` a live local;
        // this is the engine's own information, so nothing is dialled.
        let s = unsafe { orbite_peer_open(engine, info.as_ptr(), info.len(), 0, &mut peer) };
        assert_eq!(s, OrbiteStatus::Ok, "the self peer opens");
        Local { engine, peer, epoch, ranges, exports }
    })
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let options = input.u8();
    let mut blob = input.rest().to_vec();
    let local = local();
    if options & 1 != 0 && blob.len() >= 16 {
        blob[8..16].copy_from_slice(&local.epoch.to_le_bytes());
    }
    if options & 2 != 0 && blob.len() >= 20 {
        blob[12..20].copy_from_slice(&local.epoch.to_le_bytes());
    }
    if options & 4 != 0 && blob.len() >= 28 {
        let (addr, _) = local.ranges[(options as usize >> 3) % local.ranges.len()];
        blob[20..28].copy_from_slice(&addr.to_le_bytes());
    }
    peer_info(local, &blob);
    range_info(local, &blob);
}

fn peer_info(local: &Local, blob: &[u8]) {
    let decoded = decode_peer_info(blob);
    if let Ok((epoch, endpoint)) = &decoded {
        assert_eq!(encode_peer_info(*epoch, endpoint), blob, "peer information round trip");
    }
    match (plugin::peer_epoch(blob), &decoded) {
        (None, _) => {}
        (Some(Outcome::Threw), _) => panic!("the plugin's peerEpoch threw"),
        (Some(Outcome::Returned(got)), Ok((epoch, _))) => {
            assert_eq!(got, Some(*epoch), "the plugin reads the epoch the ABI reads");
        }
        (Some(Outcome::Returned(_)), Err(_)) => {}
    }
    // Only where nothing can be dialled: a refused blob, the engine's own
    // epoch (the self connection), or no endpoint at all.
    let safe = match &decoded {
        Err(_) => true,
        Ok((epoch, endpoint)) => *epoch == local.epoch || endpoint.is_empty(),
    };
    if !safe {
        return;
    }
    let mut peer = OrbitePeer::default();
    // SAFETY: `blob` is readable for its length, `peer` is a live local.
    let s = unsafe { orbite_peer_open(local.engine, blob.as_ptr(), blob.len(), 0, &mut peer) };
    match &decoded {
        Err(status) => assert_eq!(s, *status, "orbite_peer_open refuses what the parser refuses"),
        Ok((epoch, _)) if *epoch == local.epoch => {
            assert_eq!(s, OrbiteStatus::Ok, "the engine's own epoch opens the self peer");
            assert_eq!(orbite_peer_close(peer, 0), OrbiteStatus::Ok, "a self peer closes");
        }
        Ok(_) => assert_eq!(s, OrbiteStatus::NotSupported, "a peer with no listener cannot be opened"),
    }
}

fn range_info(local: &Local, blob: &[u8]) {
    let decoded = decode_range_info(blob);
    if let Ok((epoch, addr, len, permission, shared)) = decoded {
        assert_eq!(encode_range_info(epoch, addr, len, permission, shared), blob, "range metadata round trip");
    }
    let mut out = OrbiteRemoteRange {
        size: size_of::<OrbiteRemoteRange>() as u32,
        version: ORBITE_RECORD_VERSION,
        ..OrbiteRemoteRange::default()
    };
    // SAFETY: `blob` is readable for its length, `out` is a live local
    // with its size and version set.
    let s = unsafe { orbite_peer_import_range(local.peer, blob.as_ptr(), blob.len(), &mut out) };
    match decoded {
        Err(status) => assert_eq!(s, status, "orbite_peer_import_range refuses what the parser refuses"),
        Ok((epoch, addr, len, permission, _)) => {
            if s != OrbiteStatus::Ok {
                assert!(
                    matches!(s, OrbiteStatus::EpochMismatch | OrbiteStatus::NotFound),
                    "import_range of parsed metadata: {s:?}"
                );
                assert!(s != OrbiteStatus::EpochMismatch || epoch != local.epoch);
                return;
            }
            assert_eq!(epoch, local.epoch, "only the peer's epoch imports");
            assert_eq!(
                (out.addr, out.len, out.permission),
                (addr, len, permission),
                "the range imported is the one named"
            );
            assert!(local.ranges.contains(&(addr, len)), "an imported range is a registration of the peer");
        }
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    let local = local();
    let mut seeds = Vec::new();
    // The engine's own peer information (its epoch patched in at run time).
    seeds.push(Seed::new().u8(1).bytes(&encode_peer_info(1, "")).done());
    seeds.push(Seed::new().u8(0).bytes(&encode_peer_info(0x1234, "127.0.0.1:1")).done());
    seeds.push(Seed::new().u8(0).bytes(&encode_peer_info(9, "[::1]:80")).done());
    for (i, e) in local.exports.iter().enumerate() {
        // Range metadata with the epoch and address patched to this run's.
        seeds.push(Seed::new().u8(2 | 4 | ((i as u8) << 3)).bytes(e).done());
    }
    seeds.push(Seed::new().u8(0).bytes(&encode_range_info(3, 4096, 100, 2, true)).done());
    seeds
}
