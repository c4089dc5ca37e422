//! The byte formats a caller carries between processes: peer information
//! and range metadata. Both are bounded and versioned and are parsed
//! defensively: they come from another process.

use orbite_core::codec::{self, Reader, Short};

use crate::status::{Failure, OrbiteStatus, Res, fail};

const PEER_MAGIC: &[u8; 4] = b"ORBP";
const RANGE_MAGIC: &[u8; 4] = b"ORBR";
/// Version of peer information.
const PEER_VERSION: u16 = 1;
/// Version of range metadata. Version 2 names a range by its address,
/// length, permission and kind only (no registration id), so registering
/// the same range again gives byte-identical metadata; the peer's current
/// description says which registration holds it.
const RANGE_VERSION: u16 = 2;
/// Longest endpoint accepted (`host:port`).
pub(crate) const MAX_ENDPOINT: usize = 1024;

/// Who a peer is: where it listens and which incarnation it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerInfo {
    pub epoch: u64,
    pub endpoint: String,
}

/// One registered range of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeInfo {
    pub epoch: u64,
    pub addr: u64,
    pub len: u64,
    pub permission: u32,
    pub shared: bool,
}

/// Every short read of metadata.
fn truncated(_: Short) -> Failure {
    Failure::new(OrbiteStatus::InvalidArgument, "metadata is truncated")
}

/// Reads and checks the magic and version that start every blob.
fn header(r: &mut Reader<'_>, magic: &[u8; 4], version: u16, what: &str) -> Res {
    if &r.array::<4>().map_err(truncated)? != magic {
        return fail(OrbiteStatus::InvalidArgument, format!("not {what} metadata"));
    }
    match r.u16().map_err(truncated)? {
        v if v == version => Ok(()),
        v => fail(OrbiteStatus::VersionMismatch, format!("{what} metadata version {v} (this library reads {version})")),
    }
}

/// Refuses bytes after the end of a blob.
fn end(r: &Reader<'_>) -> Res {
    if r.is_empty() { Ok(()) } else { fail(OrbiteStatus::InvalidArgument, "trailing bytes after metadata") }
}

impl PeerInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.endpoint.len());
        b.extend_from_slice(PEER_MAGIC);
        codec::put_u16(&mut b, PEER_VERSION);
        codec::put_u16(&mut b, self.endpoint.len() as u16);
        codec::put_u64(&mut b, self.epoch);
        b.extend_from_slice(self.endpoint.as_bytes());
        b
    }

    pub fn decode(bytes: &[u8]) -> Res<Self> {
        let mut r = Reader::new(bytes);
        header(&mut r, PEER_MAGIC, PEER_VERSION, "peer")?;
        let len = r.u16().map_err(truncated)? as usize;
        let epoch = r.u64().map_err(truncated)?;
        if len > MAX_ENDPOINT {
            return fail(OrbiteStatus::OutOfRange, format!("endpoint of {len} bytes"));
        }
        let endpoint = std::str::from_utf8(r.take(len).map_err(truncated)?)
            .map_err(|_| Failure::new(OrbiteStatus::InvalidArgument, "endpoint is not UTF-8"))?
            .to_owned();
        end(&r)?;
        Ok(PeerInfo { epoch, endpoint })
    }
}

impl RangeInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(36);
        b.extend_from_slice(RANGE_MAGIC);
        codec::put_u16(&mut b, RANGE_VERSION);
        codec::put_u16(&mut b, u16::from(self.shared));
        codec::put_u32(&mut b, self.permission);
        for v in [self.epoch, self.addr, self.len] {
            codec::put_u64(&mut b, v);
        }
        b
    }

    pub fn decode(bytes: &[u8]) -> Res<Self> {
        let mut r = Reader::new(bytes);
        header(&mut r, RANGE_MAGIC, RANGE_VERSION, "range")?;
        let flags = r.u16().map_err(truncated)?;
        if flags > 1 {
            return fail(OrbiteStatus::InvalidArgument, format!("unknown range flags {flags:#x}"));
        }
        let permission = r.u32().map_err(truncated)?;
        let (epoch, addr, len) =
            (r.u64().map_err(truncated)?, r.u64().map_err(truncated)?, r.u64().map_err(truncated)?);
        end(&r)?;
        if len == 0 || addr.checked_add(len).is_none() {
            return fail(OrbiteStatus::OutOfRange, format!("range of {len} bytes at {addr:#x}"));
        }
        Ok(RangeInfo { epoch, addr, len, permission, shared: flags == 1 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_truncation_is_refused() {
        let p = PeerInfo { epoch: 0x1234_5678_9abc, endpoint: "127.0.0.1:4000".into() };
        let b = p.encode();
        assert_eq!(PeerInfo::decode(&b).unwrap(), p);
        for n in 0..b.len() {
            assert!(PeerInfo::decode(&b[..n]).is_err(), "prefix {n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(PeerInfo::decode(&long).is_err());
        let r = RangeInfo { epoch: 7, addr: 4096, len: 100, permission: 2, shared: true };
        let b = r.encode();
        assert_eq!(RangeInfo::decode(&b).unwrap(), r);
        for n in 0..b.len() {
            assert!(RangeInfo::decode(&b[..n]).is_err(), "prefix {n}");
        }
        assert!(RangeInfo::decode(&p.encode()).is_err(), "a peer blob is not a range");
        let mut v1 = b.clone();
        v1[4] = 1;
        assert_eq!(RangeInfo::decode(&v1).unwrap_err().status, OrbiteStatus::VersionMismatch);
        let wraps = RangeInfo { addr: u64::MAX, ..r };
        assert_eq!(RangeInfo::decode(&wraps.encode()).unwrap_err().status, OrbiteStatus::OutOfRange);
    }
}
