//! Routes: the workers that move bytes. A route knows spans and completions,
//! never policy: admission, lifecycle and accounting live above it.

pub(crate) mod local;

#[cfg(feature = "fault-injection")]
pub mod fault;

/// One contiguous copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub src: *const u8,
    pub dst: *mut u8,
    pub len: usize,
}

/// A task's slice of a copy program.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskRange {
    pub first_span: u32,
    pub end_span: u32,
    pub bytes: u64,
}

/// The resolved spans of a prepared transfer, grouped into tasks.
///
/// Built once at prepare; routes read it without locks.
#[derive(Debug, Default)]
pub(crate) struct CopyProgram {
    pub spans: Vec<Span>,
    pub tasks: Vec<TaskRange>,
}

// SAFETY: the pointers address registered memory kept alive by the range
// loans held next to the program (see `batch::plan::Plan`); the program
// itself is immutable after construction.
unsafe impl Send for CopyProgram {}
// SAFETY: as above.
unsafe impl Sync for CopyProgram {}

impl CopyProgram {
    /// Spans of task `task`.
    pub fn task_spans(&self, task: u32) -> &[Span] {
        let t = &self.tasks[task as usize];
        &self.spans[t.first_span as usize..t.end_span as usize]
    }
}

/// Copies the spans in order, at most `limit` bytes; returns bytes copied.
///
/// # Safety
/// Every span must address memory valid for its length (kept alive by the
/// caller's range loans), and no other thread may write those bytes.
pub(crate) unsafe fn copy_spans(spans: &[Span], limit: u64) -> u64 {
    let mut done = 0u64;
    for s in spans {
        let left = limit - done;
        if left == 0 {
            break;
        }
        let n = (s.len as u64).min(left) as usize;
        // SAFETY: valid per the function contract; `copy` (memmove) is used
        // because a local transfer may name overlapping ranges of one
        // registration.
        unsafe { std::ptr::copy(s.src, s.dst, n) };
        done += n as u64;
    }
    done
}
