//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`).
//!
//! The metadata blobs a caller carries between processes (peer
//! information, range metadata) are parsed by crate-private code; these
//! wrappers let a fuzz target parse hostile bytes directly, without
//! `orbite_peer_open`, which would dial whatever endpoint the bytes name.
//! Not an API: nothing but the fuzz targets should call them.

#![cfg(feature = "fuzzing")]

use crate::status::OrbiteStatus;
use crate::wire::{PeerInfo, RangeInfo};

/// Peer information, decoded: (epoch, endpoint).
pub fn decode_peer_info(bytes: &[u8]) -> Result<(u64, String), OrbiteStatus> {
    PeerInfo::decode(bytes).map(|p| (p.epoch, p.endpoint)).map_err(|f| f.status)
}

/// Encodes peer information (seeds and round trips).
pub fn encode_peer_info(epoch: u64, endpoint: &str) -> Vec<u8> {
    PeerInfo { epoch, endpoint: endpoint.to_owned() }.encode()
}

/// Range metadata, decoded: (epoch, addr, len, permission, shared).
pub fn decode_range_info(bytes: &[u8]) -> Result<(u64, u64, u64, u32, bool), OrbiteStatus> {
    RangeInfo::decode(bytes).map(|r| (r.epoch, r.addr, r.len, r.permission, r.shared)).map_err(|f| f.status)
}

/// Encodes range metadata (seeds and round trips).
pub fn encode_range_info(epoch: u64, addr: u64, len: u64, permission: u32, shared: bool) -> Vec<u8> {
    RangeInfo { epoch, addr, len, permission, shared }.encode()
}

/// Longest endpoint peer information may carry.
pub const MAX_ENDPOINT: usize = crate::wire::MAX_ENDPOINT;
