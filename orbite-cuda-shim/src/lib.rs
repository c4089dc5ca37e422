//! `orbite-cuda-shim`: a test-only stand-in for `libcuda.so`, the CUDA
//! driver API, over host memory, so machines without a GPU run the
//! engine's VRAM code paths for real. `scripts/cuda-shim` builds it and
//! makes a directory of `libcuda.so` / `libcuda.so.1` links to put on
//! `LD_LIBRARY_PATH`; cudarc's dynamic loader then finds it.
//!
//! # What it models
//!
//! - `ORBITE_CUDA_SHIM_DEVICES` devices (default 2; 0 is a successful
//!   cuInit with no devices), each with one primary context.
//!   `ORBITE_CUDA_SHIM_INIT_ERROR=<code>` makes cuInit return `code`.
//!   `ORBITE_CUDA_SHIM_COPY_DELAY_US` makes each asynchronous copy wait that
//!   long on its stream first. All three are read by the first cuInit.
//! - Device memory that the process cannot touch: every allocation is a
//!   memfd mapped `PROT_NONE` at the address handed out and read-write at an
//!   alias only the shim's copies use ([`memory`]). Code that reads "VRAM"
//!   directly faults, so passing tests show the engine reaches device memory
//!   only through the driver's copies.
//! - Pinned and registered host memory, pointer attributes, synchronous and
//!   stream-ordered copies and memsets, streams (a worker thread each) and
//!   events ([`stream`]), IPC memory handles between processes ([`ipc`]),
//!   the virtual memory management API with POSIX file descriptors as
//!   shareable handles ([`vmm`]), dma-buf exports of device memory for a
//!   NIC ([`dmabuf`], read by `orbite-verbs-shim`), and counters for tests
//!   ([`stats::orbite_cuda_shim_stats`], [`stats::orbite_cuda_shim_vmm_stats`]).
//!
//! # Contract
//!
//! Every export has the driver API's C signature and follows its
//! documented semantics for what it implements, with CUDA's `CUresult`
//! codes. Every call before a successful cuInit is
//! `CUDA_ERROR_NOT_INITIALIZED`, except cuDriverGetVersion, cuGetErrorName,
//! cuGetErrorString, `orbite_cuda_shim_stats` and
//! `orbite_cuda_shim_vmm_stats`, which work at any time. Calls that act in
//! the current context (cuMemAlloc, host allocations and registrations and
//! their frees, IPC, stream and event creation, synchronous copies and
//! memsets, anything on the null stream, cuCtxSynchronize, cuCtxGetDevice)
//! need one that is retained: `CUDA_ERROR_INVALID_CONTEXT` otherwise.
//! Pointer queries, the VMM calls and operations on created streams and
//! events do not.
//!
//! Every other name cudarc 0.18's loader resolves (`symbols.txt`) is
//! exported as a stub that returns `CUDA_ERROR_NOT_SUPPORTED` (see
//! [`ffi::not_implemented`]); `build.rs` generates them.
//!
//! # Safety
//!
//! The exports are `unsafe extern "C"`: callers pass pointers that are null
//! or valid as the driver API documents for each parameter, and host
//! memory given to an asynchronous copy stays valid until the copy has run.
//! No export unwinds: a panic (never expected) becomes `CUDA_ERROR_UNKNOWN`.

// The exports carry the driver API's names.
#![allow(non_snake_case)]
// The safety contract of every export is the driver API's, stated once
// above rather than on each of them.
#![allow(clippy::missing_safety_doc)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod context;
pub mod copy;
pub mod dmabuf;
pub mod errors;
pub mod ffi;
pub mod init;
pub mod ipc;
pub mod memory;
pub mod stats;
pub mod stream;
pub mod vmm;

/// The stubs `build.rs` generates from `symbols.txt`.
pub mod stubs {
    include!(concat!(env!("OUT_DIR"), "/stubs.rs"));
}
