//! Counters for tests: what is live, and how much was copied. Two calls:
//! `orbite_cuda_shim_stats` (the original ten counters, a layout other
//! crates read and which never changes) and `orbite_cuda_shim_vmm_stats`
//! (the virtual memory management API's).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ffi::*;

/// What `orbite_cuda_shim_stats` fills in. Another crate declares it the
/// same way to read it:
///
/// ```c
/// struct OrbiteCudaShimStats {        /* all uint64_t, in this order */
///     uint64_t device_allocations;    /* live cuMemAlloc allocations */
///     uint64_t device_bytes;          /* their requested bytes */
///     uint64_t host_allocations;      /* live cuMemHostAlloc / cuMemAllocHost */
///     uint64_t host_registrations;    /* live cuMemHostRegister ranges */
///     uint64_t ipc_imports;           /* live cuIpcOpenMemHandle mappings */
///     uint64_t streams;               /* created and not destroyed */
///     uint64_t events;                /* created and not destroyed */
///     uint64_t context_retains;       /* primary context retains outstanding, all devices */
///     uint64_t async_copies;          /* asynchronous copies executed (ever) */
///     uint64_t copied_bytes;          /* bytes copied by every cuMemcpy* (ever; not memsets) */
/// };
/// int32_t orbite_cuda_shim_stats(struct OrbiteCudaShimStats *out);  /* CUDA_SUCCESS, or
///                                       CUDA_ERROR_INVALID_VALUE for null; works before cuInit */
/// ```
///
/// In Rust: `#[repr(C)] struct OrbiteCudaShimStats { device_allocations:
/// u64, ..., copied_bytes: u64 }` with the same ten fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OrbiteCudaShimStats {
    pub device_allocations: u64,
    pub device_bytes: u64,
    pub host_allocations: u64,
    pub host_registrations: u64,
    pub ipc_imports: u64,
    pub streams: u64,
    pub events: u64,
    pub context_retains: u64,
    pub async_copies: u64,
    pub copied_bytes: u64,
}

#[derive(Clone, Copy)]
pub enum Counter {
    DeviceAllocations,
    DeviceBytes,
    HostAllocations,
    HostRegistrations,
    IpcImports,
    Streams,
    Events,
    AsyncCopies,
    CopiedBytes,
    VmmHandles,
    VmmMappings,
    VmmReservations,
    VmmBytes,
}

static COUNTERS: [AtomicU64; 13] = [const { AtomicU64::new(0) }; 13];

pub fn add(c: Counter, n: u64) {
    COUNTERS[c as usize].fetch_add(n, Ordering::Relaxed);
}

pub fn sub(c: Counter, n: u64) {
    COUNTERS[c as usize].fetch_sub(n, Ordering::Relaxed);
}

fn get(c: Counter) -> u64 {
    COUNTERS[c as usize].load(Ordering::Relaxed)
}

/// Test-only: the shim's counters (see [`OrbiteCudaShimStats`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_cuda_shim_stats(out: *mut OrbiteCudaShimStats) -> CUresult {
    entry(|| {
        let stats = OrbiteCudaShimStats {
            device_allocations: get(Counter::DeviceAllocations),
            device_bytes: get(Counter::DeviceBytes),
            host_allocations: get(Counter::HostAllocations),
            host_registrations: get(Counter::HostRegistrations),
            ipc_imports: get(Counter::IpcImports),
            streams: get(Counter::Streams),
            events: get(Counter::Events),
            context_retains: crate::context::retains_outstanding(),
            async_copies: get(Counter::AsyncCopies),
            copied_bytes: get(Counter::CopiedBytes),
        };
        // SAFETY: `out` is null or points to an OrbiteCudaShimStats.
        unsafe { write_out(out, stats) }
    })
}

/// What `orbite_cuda_shim_vmm_stats` fills in:
///
/// ```c
/// struct OrbiteCudaShimVmmStats {     /* all uint64_t, in this order */
///     uint64_t vmm_handles;           /* live allocation handles: cuMemCreate,
///                                        cuMemImportFromShareableHandle or
///                                        cuMemRetainAllocationHandle (of a released
///                                        handle) made them, cuMemRelease of the last
///                                        reference has not dropped them */
///     uint64_t vmm_mappings;          /* live cuMemMap mappings */
///     uint64_t vmm_reservations;      /* live cuMemAddressReserve ranges */
///     uint64_t vmm_bytes;             /* bytes of live physical allocations, created
///                                        or imported (an allocation lives while a
///                                        handle, a mapping or a copy in flight holds it) */
/// };
/// int32_t orbite_cuda_shim_vmm_stats(struct OrbiteCudaShimVmmStats *out);  /* CUDA_SUCCESS, or
///                                       CUDA_ERROR_INVALID_VALUE for null; works before cuInit */
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OrbiteCudaShimVmmStats {
    pub vmm_handles: u64,
    pub vmm_mappings: u64,
    pub vmm_reservations: u64,
    pub vmm_bytes: u64,
}

/// Test-only: the shim's counters of the virtual memory management API
/// (see [`OrbiteCudaShimVmmStats`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_cuda_shim_vmm_stats(out: *mut OrbiteCudaShimVmmStats) -> CUresult {
    entry(|| {
        let stats = OrbiteCudaShimVmmStats {
            vmm_handles: get(Counter::VmmHandles),
            vmm_mappings: get(Counter::VmmMappings),
            vmm_reservations: get(Counter::VmmReservations),
            vmm_bytes: get(Counter::VmmBytes),
        };
        // SAFETY: `out` is null or points to an OrbiteCudaShimVmmStats.
        unsafe { write_out(out, stats) }
    })
}
