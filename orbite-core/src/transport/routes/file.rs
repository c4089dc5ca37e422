//! The file route: io_uring reads and writes of a local file, on the local
//! workers (one ring per worker thread). Spans' `remote` are file offsets.

use std::sync::Arc;

use super::{Copier, LocalSide, Mover, NoDeviceCopy, Reach, RouteImpl, Unreachable};
use crate::file::{BouncePool, Entry, FileIo, FileOp, FileSpan};
use crate::transport::Span;
use crate::types::{Desc, Op, Route, TaskEnd};

/// The file route.
pub(crate) struct File;

impl RouteImpl for File {
    fn route(&self) -> Route {
        Route::File
    }

    fn serves(&self, target: &Reach<'_>) -> bool {
        matches!(target, Reach::File(..))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("local file")
    }

    fn plan(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<Mover, Unreachable> {
        match target {
            Reach::File((entry, bounce)) => {
                Ok(Mover::Copy(Box::new(FileCopy { entry: Arc::clone(entry), bounce: Arc::clone(bounce) })))
            }
            _ => Err(Unreachable::NotFile),
        }
    }
}

/// Reads and writes of a local file: `remote` are offsets in it;
/// unaligned spans of a direct file bounce through the engine's pool.
pub(crate) struct FileCopy {
    entry: Arc<Entry>,
    bounce: Arc<BouncePool>,
}

impl Copier for FileCopy {
    fn name(&self) -> &'static str {
        "file I/O"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        copy(&self.entry, &self.bounce, op, spans, limit)
    }

    /// Files take host memory only: device memory bounces through the
    /// staging pool's page-locked buffers, as for cma.
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        Ok(super::staging::Staged::over(self, local, None))
    }

    /// Not a direct file's: its read-modify-write may wait for another
    /// task's write of the same file (a helping caller never waits on a
    /// copy).
    fn helpable(&self) -> bool {
        self.entry.dio_align().is_none()
    }

    /// A worker waits for all of one task's operations on a direct file,
    /// so those tasks are cut larger: their operations are what is in
    /// flight at the device.
    fn task_bytes(&self, configured: u64) -> u64 {
        self.entry.dio_align().map_or(configured, |_| configured.max(crate::file::DIRECT_TASK_BYTES))
    }
}

thread_local! {
    /// Each worker's io_uring ring, made on its first file task.
    static RING: std::cell::RefCell<Option<FileIo>> = const { std::cell::RefCell::new(None) };
}

/// A file task (at most `limit` bytes): bytes landed are exact (a READ that
/// meets the end of the file is short); an I/O error is a failure, a
/// WRITE's effect then unknown.
fn copy(entry: &Entry, bounce: &BouncePool, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
    let write = op == Op::Write;
    let mut left = limit;
    let file_spans: Vec<FileSpan> = spans
        .iter()
        .map_while(|s| {
            let len = s.len.min(left);
            left -= len;
            (len > 0).then_some(FileSpan { mem: s.local as *mut u8, len, file_offset: s.remote })
        })
        .collect();
    let planned: u64 = file_spans.iter().map(|s| s.len).sum();
    let outcome = RING.with(|ring| {
        let mut ring = ring.borrow_mut();
        if ring.is_none() {
            *ring = Some(FileIo::new(64)?);
        }
        let io = ring.as_ref().expect("made above");
        let op = if write { FileOp::Write } else { FileOp::Read };
        // SAFETY: the job retains the range loans of every local span, and
        // the lifecycle admits each task once.
        unsafe { io.run_with(entry, op, &file_spans, bounce) }
    });
    match outcome {
        Ok(o) if o.error.is_some() => (o.prefix, Some(TaskEnd::Failed { effect_unknown: write })),
        Ok(o) if o.prefix < planned => (o.prefix, Some(TaskEnd::Short)),
        Ok(o) => (o.prefix, None),
        // Refused before any I/O (the file was closed, say).
        Err(_) => (0, Some(TaskEnd::Failed { effect_unknown: false })),
    }
}
