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
pub const DESCRIPTOR_VERSION: u16 = 3;
const ENTRY_FIXED: usize = 40;
const HEADER_FIXED: usize = 2 + 2 + 4 + 8 + 16 + 2;

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
    /// For a range of a shared allocation: the file name under /dev/shm and
    /// the range's offset in it.
    pub shm: Option<(String, u64)>,
}

/// What an engine exposes to peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// Where the engine listens (`host:port`).
    pub endpoint: String,
    /// The engine's identity for this run.
    pub epoch: u64,
    /// The engine's process id (for CMA).
    pub pid: u32,
    /// The kernel's boot id (all zero if unknown): same-host routes need
    /// both sides to report the same nonzero one.
    pub boot_id: [u8; 16],
    /// The engine's notification inbox under /dev/shm (empty: none).
    pub inbox: String,
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

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.at.checked_add(n).ok_or(WireError::Malformed("segment descriptor"))?;
        let s = self.b.get(self.at..end).ok_or(WireError::Malformed("segment descriptor"))?;
        self.at = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn str(&mut self, n: usize) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.take(n)?).map_err(|_| WireError::Malformed("segment descriptor"))
    }
}

impl SegmentDescriptor {
    /// Encodes the descriptor.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ep = self.endpoint.as_bytes();
        let mut out = Vec::with_capacity(HEADER_FIXED + ep.len() + 4 + self.registrations.len() * ENTRY_FIXED);
        out.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.boot_id);
        out.extend_from_slice(&(ep.len() as u16).to_le_bytes());
        out.extend_from_slice(ep);
        out.extend_from_slice(&(self.inbox.len() as u16).to_le_bytes());
        out.extend_from_slice(self.inbox.as_bytes());
        out.extend_from_slice(&(self.registrations.len() as u32).to_le_bytes());
        for r in &self.registrations {
            let (name, offset) = r.shm.as_ref().map_or(("", 0), |(n, o)| (n.as_str(), *o));
            out.extend_from_slice(&r.id.to_raw().to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.push(perm_code(r.permission));
            out.push(r.shm.is_some() as u8);
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&[0u8; 4]);
            out.extend_from_slice(name.as_bytes());
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
        let mut r = Reader { b, at: 0 };
        if r.u16()? != DESCRIPTOR_VERSION {
            return Err(bad);
        }
        r.u16()?;
        let pid = r.u32()?;
        let epoch = r.u64()?;
        let mut boot_id = [0u8; 16];
        boot_id.copy_from_slice(r.take(16)?);
        let ep_len = r.u16()? as usize;
        let endpoint = r.str(ep_len)?.to_owned();
        let inbox_len = r.u16()? as usize;
        let inbox = r.str(inbox_len)?.to_owned();
        if inbox.contains('/') || inbox.starts_with('.') {
            return Err(bad);
        }
        let count = r.u32()? as usize;
        // Each entry takes at least ENTRY_FIXED bytes: bound the count by
        // what is left before allocating.
        if count > (b.len() - r.at) / ENTRY_FIXED {
            return Err(bad);
        }
        let mut registrations = Vec::with_capacity(count);
        for _ in 0..count {
            let id = RegistrationId::from_raw(r.u64()?);
            let len = r.u64()?;
            let addr = r.u64()?;
            let offset = r.u64()?;
            let head = r.take(8)?;
            let permission = match head[0] {
                0 => Permission::LocalOnly,
                1 => Permission::RemoteRead,
                2 => Permission::RemoteReadWrite,
                _ => return Err(bad),
            };
            let shared = match head[1] {
                0 => false,
                1 => true,
                _ => return Err(bad),
            };
            let name_len = u16::from_le_bytes([head[2], head[3]]) as usize;
            let name = r.str(name_len)?;
            if shared == name.is_empty() || name.contains('/') || name.starts_with('.') {
                return Err(bad);
            }
            let shm = shared.then(|| (name.to_owned(), offset));
            registrations.push(ExportedRegistration { id, len, permission, addr, shm });
        }
        if r.at != b.len() {
            return Err(bad);
        }
        Ok(SegmentDescriptor { endpoint, epoch, pid, boot_id, inbox, registrations })
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
            endpoint: "127.0.0.1:4000".into(),
            epoch: 0xDEAD_BEEF,
            pid: 42,
            boot_id: [7; 16],
            inbox: "orbite-inbox-1".into(),
            registrations: vec![
                ExportedRegistration {
                    id: RegistrationId::from_raw(7 | (3 << 32)),
                    len: 4096,
                    permission: Permission::RemoteRead,
                    addr: 0x7000_0000,
                    shm: Some(("orbite-1-2-3".into(), 8192)),
                },
                ExportedRegistration {
                    id: RegistrationId::from_raw(1),
                    len: 1,
                    permission: Permission::RemoteReadWrite,
                    addr: 1,
                    shm: None,
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
        // A shared-memory name that could escape /dev/shm is refused.
        let mut evil = d.clone();
        evil.registrations[0].shm = Some(("../etc/passwd".into(), 0));
        assert!(SegmentDescriptor::decode(&evil.to_bytes(), 1 << 20).is_err());
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
