//! Prepare: validate two descriptor lists against the registry (and, for a
//! peer, its imported descriptor), with no I/O, and turn them into a copy
//! program grouped into route tasks.
//!
//! Every check happens here, before anything is admitted: descriptor and
//! byte limits, live registrations, bounds with checked arithmetic,
//! permissions of the target side, equal total lengths. The two lists may
//! be fragmented differently; the program walks both at once. Spans that
//! continue each other on both sides are merged; tasks are cut at
//! `task_bytes` (and at 4096 spans), splitting a large descriptor where
//! needed.

use std::sync::Arc;

use crate::batch::{Desc, TransferOptions};
use crate::config::EngineConfig;
use crate::engine::TransferSpec;
use crate::error::{BatchError, Error, PeerError};
use crate::registry::{Registration, Table};
use crate::transport::routes::{Mover, Reach, RouteImpl};
use crate::transport::{CopyProgram, Span, TaskRange};
use crate::types::{Op, Permission, RegistrationId, Resource};

/// A validated transfer: its copy program, immutable after prepare.
pub(crate) struct Plan {
    pub program: CopyProgram,
    pub total_bytes: u64,
    pub options: TransferOptions,
    pub notification: Option<Box<[u8]>>,
}

/// The range loans that keep every registration a plan names (and its
/// backing) alive; the program's pointers are valid while they live.
pub(crate) type Loans = Vec<Arc<Registration>>;

/// A registration as prepare sees it: of this engine, or of a peer's
/// imported descriptor.
#[derive(Clone, Copy)]
struct View {
    id: RegistrationId,
    /// Base address (this engine) or 0 (a peer: spans carry offsets).
    base: u64,
    /// Raw id carried on the wire (a peer) or 0 (this engine).
    wire_id: u64,
    len: u64,
    permission: Permission,
    /// Take a range loan on it (this engine's registrations).
    loan: bool,
}

/// A resolved descriptor: an address (or, on a peer, an offset in the
/// peer registration `reg`) and a length.
#[derive(Clone, Copy)]
struct Resolved {
    addr: u64,
    reg: u64,
    len: u64,
}

/// A permission the target side needs: its name and its test.
type Needs = (&'static str, fn(Permission) -> bool);

fn resolve(
    side: &'static str,
    descs: &[Desc],
    config: &EngineConfig,
    needs: Option<Needs>,
    mut lookup: impl FnMut(RegistrationId) -> Result<View, Error>,
    ids: &mut Vec<RegistrationId>,
) -> Result<(Vec<Resolved>, u64), Error> {
    let invalid = |index: usize, reason: String| BatchError::InvalidDescriptor { side, index, reason };
    if descs.is_empty() {
        return Err(invalid(0, "empty descriptor list".into()).into());
    }
    if descs.len() as u64 > config.max_descriptors_per_transfer {
        return Err(Error::ResourceExhausted {
            resource: Resource::DescriptorsPerTransfer,
            limit: config.max_descriptors_per_transfer,
            requested: descs.len() as u64,
        });
    }
    let mut out = Vec::with_capacity(descs.len());
    let mut total = 0u64;
    let mut last: Option<View> = None;
    for (index, d) in descs.iter().enumerate() {
        let reg = match last {
            Some(v) if v.id == d.registration => v,
            _ => {
                let v = lookup(d.registration)?;
                if v.loan {
                    ids.push(v.id);
                }
                last = Some(v);
                v
            }
        };
        if d.len == 0 {
            return Err(invalid(index, "zero length".into()).into());
        }
        let end = d.offset.checked_add(d.len).ok_or_else(|| invalid(index, "offset + len overflows".into()))?;
        if end > reg.len {
            return Err(invalid(
                index,
                format!("{}..{end} exceeds registration {} of {} bytes", d.offset, reg.id, reg.len),
            )
            .into());
        }
        if let Some((needed, allowed)) = needs {
            if !allowed(reg.permission) {
                return Err(BatchError::PermissionDenied { id: reg.id, needed }.into());
            }
        }
        total = total.checked_add(d.len).ok_or_else(|| invalid(index, "total length overflows".into()))?;
        if total > config.max_transfer_bytes {
            return Err(Error::ResourceExhausted {
                resource: Resource::TransferBytes,
                limit: config.max_transfer_bytes,
                requested: total,
            });
        }
        // In bounds: offset + len <= registration length (checked); the
        // base may come from a peer, so the address range is checked too.
        let addr = reg
            .base
            .checked_add(d.offset)
            .filter(|a| a.checked_add(d.len).is_some())
            .ok_or_else(|| invalid(index, "address range overflows".into()))?;
        out.push(Resolved { addr, reg: reg.wire_id, len: d.len });
    }
    Ok((out, total))
}

fn local_view(table: &Table, id: RegistrationId) -> Result<View, Error> {
    let r = table.get(id)?;
    Ok(View { id: r.id, base: r.base as u64, wire_id: 0, len: r.len, permission: r.permission, loan: true })
}

/// Validates `spec` against the locked registry (and, for a peer, its
/// imported registrations, addressed by `route`; for a file, its extents,
/// offsets below 2^63) and builds its plan.
pub(crate) fn build(
    spec: &TransferSpec<'_>,
    target: &Reach<'_>,
    route: &dyn RouteImpl,
    mover: Mover,
    table: &Table,
    config: &EngineConfig,
    pool: &Arc<crate::transport::routes::staging::StagingPool>,
) -> Result<(Plan, Loans), Error> {
    let mut ids = Vec::new();
    let (local, local_total) = resolve("local", spec.local, config, None, |id| local_view(table, id), &mut ids)?;
    let needs: Needs = match spec.op {
        Op::Write => ("remote write", Permission::remote_write),
        Op::Read => ("remote read", Permission::remote_read),
    };
    let (remote, remote_total) = match target {
        Reach::Loopback => resolve("remote", spec.remote, config, Some(needs), |id| local_view(table, id), &mut ids)?,
        Reach::Peer(reach) => {
            let regs = reach.segment.registrations();
            let peer_view = |id: RegistrationId| -> Result<View, Error> {
                let r = regs.get(&id.to_raw()).ok_or(PeerError::UnknownRemoteRegistration(id))?;
                let (base, wire_id) = route
                    .address(reach, r)
                    .map_err(|why| PeerError::RouteUnavailable { route: route.route(), reason: why.to_string() })?;
                Ok(View { id, base, wire_id, len: r.len, permission: r.permission, loan: false })
            };
            resolve("remote", spec.remote, config, Some(needs), peer_view, &mut ids)?
        }
        Reach::File((entry, _)) => {
            let writable = entry.mode() == crate::file::FileMode::ReadWrite;
            let permission = if writable { Permission::RemoteReadWrite } else { Permission::RemoteRead };
            let file_view = |id: RegistrationId| -> Result<View, Error> {
                Ok(View { id, base: 0, wire_id: 0, len: i64::MAX as u64, permission, loan: false })
            };
            resolve("remote", spec.remote, config, Some(needs), file_view, &mut ids)?
        }
    };
    if let Some(n) = spec.notification {
        if n.len() as u64 > config.max_notification_bytes {
            return Err(
                PeerError::NotificationTooLarge { len: n.len() as u64, limit: config.max_notification_bytes }.into()
            );
        }
    }
    if local_total != remote_total {
        return Err(BatchError::LengthMismatch { local: local_total, remote: remote_total }.into());
    }
    // Spans are at most one per descriptor of each list plus one per task
    // cut; bound that before allocating (a tiny task_bytes could otherwise
    // turn one large descriptor into millions of spans).
    let span_bound = (local.len() + remote.len()) as u64 + local_total / config.task_bytes;
    let span_limit = config.max_descriptors_per_transfer.saturating_mul(4);
    if span_bound > span_limit {
        return Err(Error::ResourceExhausted {
            resource: Resource::DescriptorsPerTransfer,
            limit: span_limit,
            requested: span_bound,
        });
    }
    ids.sort_unstable();
    ids.dedup();
    let loans = ids.iter().map(|id| table.get(*id).cloned()).collect::<Result<Vec<_>, _>>()?;
    let mover = mover.for_memory(&loans, config, pool).map_err(|e| Error::NotSupported(e.to_string()))?;
    let cut = mover.task_bytes(config.task_bytes);
    let program = build_program(spec.op, mover, &local, &remote, cut);
    if let Some((index, reason)) = program.mover.copies().and_then(|c| c.refuse(program.op, &program.spans)) {
        return Err(BatchError::InvalidDescriptor { side: "remote", index, reason }.into());
    }
    let plan = Plan {
        program,
        total_bytes: local_total,
        options: spec.options,
        notification: spec.notification.map(Box::from),
    };
    Ok((plan, loans))
}

/// Most spans in one route task (bounds a peer request's body).
pub(crate) const MAX_SPANS_PER_TASK: u32 = 4096;

/// Walks both fragmentations at once. Both cover the same total.
fn build_program(op: Op, mover: Mover, local: &[Resolved], remote: &[Resolved], task_bytes: u64) -> CopyProgram {
    let mut spans: Vec<Span> = Vec::with_capacity(local.len().max(remote.len()));
    let mut tasks: Vec<TaskRange> = Vec::new();
    let (mut i, mut j) = (0usize, 0usize);
    let (mut li, mut rj) = (0u64, 0u64); // consumed bytes of local[i], remote[j]
    let mut task = TaskRange { first_span: 0, end_span: 0, bytes: 0 };
    while i < local.len() && j < remote.len() {
        let n = (local[i].len - li).min(remote[j].len - rj).min(task_bytes - task.bytes);
        let next = Span { local: local[i].addr + li, remote: remote[j].addr + rj, remote_reg: remote[j].reg, len: n };
        let merged = match spans.last_mut() {
            Some(prev)
                if task.end_span > task.first_span
                    && prev.local + prev.len == next.local
                    && prev.remote_reg == next.remote_reg
                    && prev.remote + prev.len == next.remote =>
            {
                prev.len += n;
                true
            }
            _ => false,
        };
        if !merged {
            spans.push(next);
            task.end_span = spans.len() as u32;
        }
        task.bytes += n;
        li += n;
        rj += n;
        if li == local[i].len {
            i += 1;
            li = 0;
        }
        if rj == remote[j].len {
            j += 1;
            rj = 0;
        }
        if task.bytes == task_bytes || task.end_span - task.first_span == MAX_SPANS_PER_TASK {
            tasks.push(task);
            task = TaskRange { first_span: spans.len() as u32, end_span: spans.len() as u32, bytes: 0 };
        }
    }
    if task.bytes > 0 {
        tasks.push(task);
    }
    CopyProgram { op, mover, spans, tasks }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The self connection's copies.
    fn memory() -> Mover {
        Mover::Copy(Box::new(crate::transport::routes::loopback::Memory))
    }

    /// The file route's copies of `entry`.
    fn file(entry: Arc<crate::file::Entry>, bounce: &Arc<crate::file::BouncePool>) -> Mover {
        let target = Reach::File((&entry, bounce));
        crate::transport::routes::by_name(crate::types::Route::File).plan(&target, &[]).unwrap()
    }

    fn r(addr: u64, len: u64) -> Resolved {
        Resolved { addr, reg: 0, len }
    }

    fn flatten(p: &CopyProgram) -> Vec<(u64, u64, u64)> {
        p.spans.iter().map(|s| (s.local, s.remote, s.len)).collect()
    }

    #[test]
    fn direct_files_are_cut_into_tasks_that_keep_operations_in_flight() {
        use crate::file::{BouncePool, DIRECT_TASK_BYTES, Entry, FileMode, OpenFlags};
        let path = std::env::temp_dir().join(format!("orbite-plan-direct-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let bounce = BouncePool::new(1 << 20);
        let buffered = Arc::new(Entry::open(&path, FileMode::ReadWrite, OpenFlags::default()).unwrap());
        assert_eq!(file(buffered, &bounce).task_bytes(1 << 20), 1 << 20);
        match Entry::open(&path, FileMode::ReadWrite, OpenFlags { direct: true, ..OpenFlags::default() }) {
            Ok(direct) => {
                let kind = file(Arc::new(direct), &bounce);
                assert_eq!(kind.task_bytes(1 << 20), DIRECT_TASK_BYTES);
                assert_eq!(kind.task_bytes(64 << 20), 64 << 20, "a larger setting stands");
                let one = [r(0, 48 << 20)];
                let cut = kind.task_bytes(1 << 20);
                let p = build_program(Op::Write, kind, &one, &one, cut);
                assert_eq!(p.tasks.len(), 3);
            }
            Err(e) => println!("SKIP: {} refuses O_DIRECT here ({e})", path.display()),
        }
        assert_eq!(memory().task_bytes(1 << 20), 1 << 20);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn different_fragmentations_meet_in_spans() {
        let p = build_program(Op::Write, memory(), &[r(1000, 10), r(2000, 20)], &[r(5000, 25), r(9000, 5)], 1 << 20);
        assert_eq!(flatten(&p), vec![(1000, 5000, 10), (2000, 5010, 15), (2015, 9000, 5)]);
        assert_eq!(p.tasks.len(), 1);
        assert_eq!(p.tasks[0].bytes, 30);
    }

    #[test]
    fn contiguous_descriptors_merge_and_tasks_split_large_ones() {
        let p = build_program(
            Op::Read,
            memory(),
            &[r(0x1000, 4), r(0x1004, 4), r(0x1008, 16)],
            &[r(0x8000, 8), r(0x8008, 16)],
            10,
        );
        assert_eq!(flatten(&p), vec![(0x1000, 0x8000, 10), (0x100a, 0x800a, 10), (0x1014, 0x8014, 4)]);
        let bytes: Vec<u64> = p.tasks.iter().map(|t| t.bytes).collect();
        assert_eq!(bytes, vec![10, 10, 4]);
        for t in 0..3 {
            assert_eq!(p.task_spans(t).len(), 1);
        }
    }

    #[test]
    fn spans_never_merge_across_tasks_or_remote_registrations() {
        let p = build_program(Op::Write, memory(), &[r(0, 8)], &[r(100, 8)], 4);
        assert_eq!(p.tasks.len(), 2);
        assert_eq!(p.task_spans(1)[0].local, 4);
        let a = Resolved { addr: 0, reg: 1, len: 4 };
        let b = Resolved { addr: 4, reg: 2, len: 4 };
        let p = build_program(Op::Write, memory(), &[r(0, 8)], &[a, b], 100);
        assert_eq!(p.spans.len(), 2, "same offsets in different registrations never merge");
    }

    #[test]
    fn tasks_are_cut_at_the_span_limit() {
        let n = MAX_SPANS_PER_TASK as u64 + 10;
        let local: Vec<Resolved> = (0..n).map(|i| r(i * 2, 1)).collect();
        let remote: Vec<Resolved> = (0..n).map(|i| r(100_000 + i * 2, 1)).collect();
        let p = build_program(Op::Write, memory(), &local, &remote, 1 << 30);
        assert_eq!(p.tasks.len(), 2);
        assert_eq!(p.task_spans(0).len() as u32, MAX_SPANS_PER_TASK);
    }
}
