//! Segments: what one engine exposes to peers, and the lease a peer holds
//! on what it imported.
//!
//! The [`SegmentDescriptor`] (endpoint, epoch, and per registration its id,
//! generation, bounds, kind and permission) is a bounded, versioned byte
//! string, exchanged out of band (NIXL carries it as connection info and
//! public metadata) or fetched with a Describe request. The Describe reply
//! is authoritative: `open_segment` checks the epoch it reports.

use crate::memory::Permission;
use crate::registry::RegistrationId;
use crate::wire::WireError;

/// Version of the descriptor encoding.
pub const DESCRIPTOR_VERSION: u16 = 1;
const ENTRY_LEN: usize = 24;
const FIXED_LEN: usize = 2 + 2 + 4 + 8 + 2 + 4;

/// One exported registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExportedRegistration {
    /// Id (index and generation) at the exporting engine.
    pub id: RegistrationId,
    /// Length in bytes.
    pub len: u64,
    /// What peers may do with it.
    pub permission: Permission,
}

/// What an engine exposes to peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// Where the engine listens (`host:port`).
    pub endpoint: String,
    /// The engine's identity for this run.
    pub epoch: u64,
    /// The engine's process id (for same-host routes).
    pub pid: u32,
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

impl SegmentDescriptor {
    /// Encodes the descriptor.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ep = self.endpoint.as_bytes();
        let mut out = Vec::with_capacity(FIXED_LEN + ep.len() + self.registrations.len() * ENTRY_LEN);
        out.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&(ep.len() as u16).to_le_bytes());
        out.extend_from_slice(ep);
        out.extend_from_slice(&(self.registrations.len() as u32).to_le_bytes());
        for r in &self.registrations {
            out.extend_from_slice(&r.id.to_raw().to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.push(perm_code(r.permission));
            out.extend_from_slice(&[0u8; 7]);
        }
        out
    }

    /// Decodes a descriptor of at most `max_len` bytes; the layout must be
    /// exact.
    pub fn decode(b: &[u8], max_len: usize) -> Result<Self, WireError> {
        let bad = WireError::Malformed("segment descriptor");
        if b.len() > max_len {
            return Err(WireError::TooLong { what: "segment descriptor", len: b.len() as u64, limit: max_len as u64 });
        }
        if b.len() < FIXED_LEN || u16::from_le_bytes([b[0], b[1]]) != DESCRIPTOR_VERSION {
            return Err(bad);
        }
        let pid = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let epoch = u64::from_le_bytes(b[8..16].try_into().map_err(|_| bad.clone())?);
        let ep_len = u16::from_le_bytes([b[16], b[17]]) as usize;
        let ep = b.get(18..18 + ep_len).ok_or(bad.clone())?;
        let endpoint = std::str::from_utf8(ep).map_err(|_| bad.clone())?.to_owned();
        let at = 18 + ep_len;
        let count = b.get(at..at + 4).ok_or(bad.clone())?;
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
        let entries = &b[at + 4..];
        if count.checked_mul(ENTRY_LEN) != Some(entries.len()) {
            return Err(bad);
        }
        let mut registrations = Vec::with_capacity(count);
        for e in entries.chunks_exact(ENTRY_LEN) {
            let id = RegistrationId::from_raw(u64::from_le_bytes(e[0..8].try_into().map_err(|_| bad.clone())?));
            let len = u64::from_le_bytes(e[8..16].try_into().map_err(|_| bad.clone())?);
            let permission = match e[16] {
                0 => Permission::LocalOnly,
                1 => Permission::RemoteRead,
                2 => Permission::RemoteReadWrite,
                _ => return Err(bad),
            };
            registrations.push(ExportedRegistration { id, len, permission });
        }
        Ok(SegmentDescriptor { endpoint, epoch, pid, registrations })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trip_and_exact_layout() {
        let d = SegmentDescriptor {
            endpoint: "127.0.0.1:4000".into(),
            epoch: 0xDEAD_BEEF,
            pid: 42,
            registrations: vec![
                ExportedRegistration {
                    id: RegistrationId::from_raw(7 | (3 << 32)),
                    len: 4096,
                    permission: Permission::RemoteRead,
                },
                ExportedRegistration {
                    id: RegistrationId::from_raw(1),
                    len: 1,
                    permission: Permission::RemoteReadWrite,
                },
            ],
        };
        let b = d.to_bytes();
        assert_eq!(SegmentDescriptor::decode(&b, 1 << 20).unwrap(), d);
        assert!(SegmentDescriptor::decode(&b[..b.len() - 1], 1 << 20).is_err());
        let mut longer = b.clone();
        longer.push(0);
        assert!(SegmentDescriptor::decode(&longer, 1 << 20).is_err());
        assert!(matches!(SegmentDescriptor::decode(&b, 10), Err(WireError::TooLong { .. })));
    }
}
