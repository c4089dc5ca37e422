//! GPU memory: the CUDA driver, loaded at run time (feature `cuda`).
//!
//! The driver is `libcuda.so`, found the way the dynamic loader finds any
//! library (`LD_LIBRARY_PATH`, the loader cache), through `cudarc`'s
//! run-time loading: a build with the feature still starts, runs and tests
//! on a machine without CUDA. [`availability`] says once per process what
//! this machine offers: the devices, or why there are none (built without
//! the feature, no driver, a driver that fails to initialise, no device).
//! Without it VRAM is not offered, and every VRAM registration is refused
//! with `NotSupported` naming that reason.
//!
//! The engine reaches device memory only through driver copies: it never
//! dereferences a device pointer, and a device registration is never handed
//! to a route that copies with the CPU.

use std::fmt;

/// Why the CUDA driver did not do what was asked. Every error of this
/// module is one of these; the memory layer and the routes turn them into
/// `NotSupported`, `InvalidRange` or a failed task, with this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// This build has no CUDA support.
    #[error("VRAM needs the CUDA driver API: this build was made without feature `cuda`")]
    NotBuilt,
    /// The dynamic loader found no `libcuda.so`.
    #[error("no CUDA driver: libcuda.so was not found by the dynamic loader")]
    NoDriver,
    /// The driver lacks functions of CUDA 12.2.
    #[error("the CUDA driver found lacks functions of CUDA 12.2 (driver too old)")]
    DriverTooOld,
    /// The driver library could not be loaded.
    #[error("the CUDA driver could not be loaded")]
    DriverNotLoaded,
    /// The driver reports no device.
    #[error("no CUDA device: the driver reports none")]
    NoDevice,
    /// The driver is not usable (one of the reasons above).
    #[error("VRAM is not available: {0}")]
    Unavailable(Box<CudaError>),
    /// An ordinal at or above the driver's device count.
    #[error("no CUDA device {ordinal} (the driver reports {devices})")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the driver reports.
        devices: u32,
    },
    /// A peer's device is not visible to this process.
    #[error("the peer's device is not visible to this process (CUDA_VISIBLE_DEVICES?)")]
    DeviceNotVisible,
    /// A driver call returned an error.
    #[error("{call} failed: {name}")]
    Call {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
        /// The driver's name of the code.
        name: String,
    },
    /// Copies queued on a stream ended with an error.
    #[error("the device copies ended with {name}")]
    Copies {
        /// The `CUresult` of the event.
        code: i32,
        /// The driver's name of the code.
        name: String,
    },
    /// A range the driver does not vouch for as asked, and why.
    #[error("{0}")]
    Range(String),
    /// An allocation that cannot be shared with, or opened from, a peer,
    /// and why.
    #[error("{0}")]
    Ipc(String),
}

/// What the CUDA driver of this machine offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaInfo {
    /// Devices the driver reports (at least one).
    pub devices: u32,
    /// The driver's CUDA version (`cuDriverGetVersion`: 12020 for 12.2).
    pub driver_version: i32,
}

/// Whether VRAM can be registered here: the driver's devices, or why not
/// (the reason names what is missing). Loaded and initialised once per
/// process; never panics.
pub fn availability() -> Result<CudaInfo, CudaError> {
    #[cfg(feature = "cuda")]
    {
        driver::get().map(|d| d.info)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(CudaError::NotBuilt)
    }
}

/// The PCI address of device `ordinal` (`dddd:bb:dd.0`, lower case, as
/// sysfs names it), for finding the NIC closest to it.
pub fn pci_bus_id(ordinal: u32) -> Result<String, CudaError> {
    driver::pci_bus_id(ordinal)
}

/// Directions of [`reference_copy_gbps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Page-locked host memory to the device.
    HostToDevice,
    /// The device to page-locked host memory.
    DeviceToHost,
    /// Device memory to device memory of the same device.
    DeviceToDevice,
}

/// The driver's own copy bandwidth on device `device` in GB/s: `len`-byte
/// `cuMemcpyAsync` copies on one stream, `iters` of them, walking through
/// `span` bytes (at least `len`) as a transfer of that size walks through
/// its blocks, so that the reference has the transfers' working set and
/// not a cache-resident one; page-locked host memory where a host side is
/// involved; each waited for with an event. The reference the bench's
/// `vram-*` rows compare with (the machine's limit for staging and
/// device-to-device copies).
pub fn reference_copy_gbps(
    device: u32,
    direction: CopyDirection,
    len: u64,
    span: u64,
    iters: u32,
) -> Result<f64, CudaError> {
    #[cfg(feature = "cuda")]
    {
        let span = span.max(len);
        let blocks = span / len;
        let dev = driver::DeviceAllocation::new(device, blocks * len)?;
        let other = driver::DeviceAllocation::new(device, blocks * len)?;
        let host = driver::PinnedBuffer::new(device, blocks * len)?;
        let copy = |i: u64| {
            let at = (i % blocks) * len;
            match direction {
                CopyDirection::HostToDevice => (dev.ptr + at, host.addr() + at, len),
                CopyDirection::DeviceToHost => (host.addr() + at, dev.ptr + at, len),
                CopyDirection::DeviceToDevice => (other.ptr + at, dev.ptr + at, len),
            }
        };
        let copies = |n: u64| {
            (0..n).try_for_each(|i| match driver::copy_on_stream(device, &[copy(i)]) {
                (_, Some(e)) => Err(e),
                (_, None) => Ok(()),
            })
        };
        // One pass to warm up, then the measured copies, one event wait each.
        copies(blocks)?;
        let start = std::time::Instant::now();
        copies(iters.max(1) as u64)?;
        let secs = start.elapsed().as_secs_f64();
        driver::release_thread_streams();
        Ok(len as f64 * iters.max(1) as f64 / secs / 1e9)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, direction, len, span, iters);
        Err(CudaError::NotBuilt)
    }
}

/// Where a device range lives, as the driver reports it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceRange {
    /// The CUDA ordinal.
    pub device: u32,
    /// The allocation containing the range: its start and size.
    pub alloc_base: u64,
    pub alloc_len: u64,
    /// The driver's id of that allocation (a freed and reused address gets
    /// a new one).
    pub buffer_id: u64,
    /// Physical allocations the range spans: 1, or more for consecutive
    /// mappings of the virtual memory management API (`alloc_base` and
    /// `alloc_len` are then the first one's).
    pub chunks: u64,
}

impl fmt::Debug for DeviceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {} allocation {:#x}+{} (buffer {}, {} physical allocations)",
            self.device, self.alloc_base, self.alloc_len, self.buffer_id, self.chunks
        )
    }
}

pub(crate) use driver::{
    ContextLease, DeviceAllocation, HostPin, IpcMapping, PinnedBuffer, Stager, Ticket, await_ticket, copy_on_stream,
    dmabuf_of, ipc_export, issue_on_stream, release_thread_streams, validate, wait_ticket,
};

/// How a target hands a same-host peer the allocation holding a
/// device registration.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "made by the driver only"))]
pub(crate) enum IpcHandle {
    /// A legacy CUDA IPC handle (`cuIpcGetMemHandle`).
    Legacy([u8; 64]),
    /// A shareable handle of the virtual memory management API
    /// (`cuMemExportToShareableHandle`, a POSIX file descriptor): memory
    /// made with `cuMemCreate` (PyTorch's expandable segments), which
    /// has no legacy handle.
    Shareable(std::os::fd::OwnedFd),
}

/// What a target hands a same-host peer for one device registration:
/// a handle of the allocation holding it.
pub(crate) struct IpcExport {
    pub handle: IpcHandle,
    pub uuid: [u8; 16],
    pub alloc_base: u64,
    pub alloc_len: u64,
}

#[cfg(feature = "cuda")]
mod driver {
    use std::ffi::{CStr, c_void};
    use std::sync::OnceLock;

    use cudarc::driver::sys;

    use super::{CudaError, CudaInfo, DeviceRange, IpcExport, IpcHandle};

    pub(super) struct Driver {
        pub info: CudaInfo,
    }

    static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

    /// The loaded, initialised driver, or why there is none.
    pub(super) fn get() -> Result<&'static Driver, CudaError> {
        DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
    }

    /// The driver, for the memory layer: `Err` is the reason to refuse.
    pub(crate) fn driver() -> Result<&'static Driver, CudaError> {
        get().map_err(|why| CudaError::Unavailable(Box::new(why)))
    }

    fn load() -> Result<Driver, CudaError> {
        // cudarc resolves every function of its CUDA 12.2 list when it
        // loads the library and panics if one is missing (a driver older
        // than 12.2): that, too, is "no usable driver", never a crash.
        let present = std::panic::catch_unwind(|| {
            // SAFETY: loads a shared library by cudarc's candidate names.
            unsafe { sys::is_culib_present() }
        });
        match present {
            Ok(true) => {}
            Ok(false) => return Err(CudaError::NoDriver),
            Err(_) => return Err(CudaError::DriverTooOld),
        }
        let loaded = std::panic::catch_unwind(|| {
            // SAFETY: as above; this keeps the library loaded for the process.
            unsafe { sys::culib() };
        });
        if loaded.is_err() {
            return Err(CudaError::DriverNotLoaded);
        }
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut version = 0;
            check(sys::cuDriverGetVersion(&mut version), "cuDriverGetVersion")?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if count <= 0 {
                return Err(CudaError::NoDevice);
            }
            Ok(Driver { info: CudaInfo { devices: count as u32, driver_version: version } })
        }
    }

    pub(crate) fn pci_bus_id(ordinal: u32) -> Result<String, CudaError> {
        get()?;
        use sys::CUdevice_attribute as A;
        let attr = |device, a| {
            let mut v = 0;
            // SAFETY: a device handle of the initialised driver and an
            // out-pointer.
            check(unsafe { sys::cuDeviceGetAttribute(&mut v, a, device) }, "cuDeviceGetAttribute").map(|()| v)
        };
        let mut device = 0;
        // SAFETY: an out-pointer.
        check(unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) }, "cuDeviceGet")?;
        let domain = attr(device, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
        let bus = attr(device, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
        let dev = attr(device, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
        Ok(format!("{domain:04x}:{bus:02x}:{dev:02x}.0"))
    }

    /// The driver's name of an error code.
    pub(crate) fn name(r: sys::CUresult) -> String {
        let mut p: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string or
        // leaves it null.
        if unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: a NUL-terminated static string of the driver.
            return unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        }
        format!("{r:?}")
    }

    pub(crate) fn check(r: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CudaError::Call { call, code: r as i32, name: name(r) })
        }
    }

    /// A reference on a device's primary context, held as long as anything
    /// may still copy to or from that device's memory (a registration, an
    /// engine allocation); released exactly once, on drop.
    pub(crate) struct ContextLease {
        ordinal: u32,
        device: sys::CUdevice,
        ctx: sys::CUcontext,
    }

    // SAFETY: a CUcontext is a driver handle usable from any thread; the
    // lease only retains and releases it.
    unsafe impl Send for ContextLease {}
    // SAFETY: as above; no interior state.
    unsafe impl Sync for ContextLease {}

    impl ContextLease {
        pub(crate) fn retain(ordinal: u32) -> Result<Self, CudaError> {
            let d = driver()?;
            if ordinal >= d.info.devices {
                return Err(CudaError::NoSuchDevice { ordinal, devices: d.info.devices });
            }
            let mut device = 0;
            let mut ctx = std::ptr::null_mut();
            // SAFETY: an ordinal below the device count; valid out-pointers.
            unsafe {
                check(sys::cuDeviceGet(&mut device, ordinal as i32), "cuDeviceGet")?;
                check(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "cuDevicePrimaryCtxRetain")?;
            }
            Ok(ContextLease { ordinal, device, ctx })
        }

        /// The CUDA ordinal.
        pub(crate) fn device(&self) -> u32 {
            self.ordinal
        }

        /// Makes the context current on this thread until the guard drops
        /// (the thread's own current context is restored then).
        pub(crate) fn enter(&self) -> Result<Current, CudaError> {
            // SAFETY: a context this lease retains.
            check(unsafe { sys::cuCtxPushCurrent_v2(self.ctx) }, "cuCtxPushCurrent")?;
            Ok(Current(()))
        }
    }

    impl Drop for ContextLease {
        fn drop(&mut self) {
            // SAFETY: balances the retain of `retain`, once.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        }
    }

    /// A context pushed by [`ContextLease::enter`]; popped on drop.
    pub(crate) struct Current(());

    impl Drop for Current {
        fn drop(&mut self) {
            let mut old = std::ptr::null_mut();
            // SAFETY: pops the context `enter` pushed on this thread.
            unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }

    /// What the driver says of the allocation holding `ptr`: memory type,
    /// device ordinal, start and size of the allocation, buffer id.
    fn attributes(ptr: u64) -> Result<(u32, i32, u64, u64, u64), CudaError> {
        use sys::CUpointer_attribute_enum as A;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            A::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        ];
        let mut memtype: u32 = 0;
        let mut device: i32 = -1;
        let mut start: u64 = 0;
        let mut size: usize = 0;
        let mut buffer: u64 = 0;
        let mut data: [*mut c_void; 5] = [
            (&mut memtype as *mut u32).cast(),
            (&mut device as *mut i32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
            (&mut buffer as *mut u64).cast(),
        ];
        // SAFETY: five attributes, each with a live out-value of the type
        // the driver writes for it.
        let r = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
        check(r, "cuPointerGetAttributes")?;
        Ok((memtype, device, start, size as u64, buffer))
    }

    /// Whether `addr` lies in memory of the virtual memory management API
    /// (a `cuMemMap` mapping of a `cuMemCreate` allocation).
    fn is_vmm(addr: u64) -> bool {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: a valid out-pointer; the driver checks the address.
        let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut c_void) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return false;
        }
        // SAFETY: balances the retain, once.
        unsafe { sys::cuMemRelease(handle) };
        true
    }

    /// Most physical allocations one registration of VMM memory spans.
    const MAX_CHUNKS: u64 = 1 << 20;

    /// Checks with the driver that `ptr..ptr + len` is device memory of
    /// device `ordinal`, inside one allocation; or, for memory of the
    /// virtual memory management API (PyTorch's expandable segments map
    /// many physical allocations back to back), inside consecutive VMM
    /// mappings of that device with no gap. Checked arithmetic only.
    pub(crate) fn validate(ordinal: u32, ptr: u64, len: u64) -> Result<DeviceRange, CudaError> {
        driver()?;
        if len == 0 || ptr == 0 {
            return Err(CudaError::Range("a null or empty device range".into()));
        }
        let range_err = CudaError::Range;
        let end = ptr.checked_add(len).ok_or_else(|| range_err(format!("{ptr:#x}+{len} wraps the address space")))?;
        let device_memory = |at: u64| -> Result<(u64, u64, u64), CudaError> {
            let (memtype, device, start, size, buffer) = attributes(at)?;
            if memtype != sys::CUmemorytype_enum::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(range_err(format!("{at:#x} is not CUDA device memory (memory type {memtype})")));
            }
            if device < 0 || device as u32 != ordinal {
                return Err(range_err(format!("{at:#x} is memory of CUDA device {device}, not of device {ordinal}")));
            }
            Ok((start, size, buffer))
        };
        let (start, size, buffer) = device_memory(ptr)?;
        let alloc_end = start.checked_add(size).ok_or_else(|| range_err("the allocation wraps".to_owned()))?;
        let range = DeviceRange { device: ordinal, alloc_base: start, alloc_len: size, buffer_id: buffer, chunks: 1 };
        if ptr < start {
            return Err(range_err(format!("{ptr:#x} lies before its allocation {start:#x}+{size}")));
        }
        if end <= alloc_end {
            return Ok(range);
        }
        let crosses = || {
            format!(
                "{ptr:#x}+{len} crosses its allocation {start:#x}+{size}: a registration lies inside one allocation"
            )
        };
        if !is_vmm(ptr) {
            return Err(range_err(crosses()));
        }
        // VMM memory: the next physical allocation must be mapped right
        // after this one, on the same device, until the range ends.
        let (mut at, mut chunks) = (alloc_end, 1u64);
        while at < end {
            if chunks == MAX_CHUNKS || !is_vmm(at) {
                return Err(range_err(format!("{} (no VMM mapping at {at:#x})", crosses())));
            }
            let (next, size, _) = device_memory(at).map_err(|e| range_err(format!("{}: {e}", crosses())))?;
            if next != at || size == 0 {
                return Err(range_err(format!("{}: the mapping at {at:#x} starts at {next:#x}", crosses())));
            }
            at = next.checked_add(size).ok_or_else(|| range_err("the allocation wraps".to_owned()))?;
            chunks += 1;
        }
        Ok(DeviceRange { chunks, ..range })
    }

    /// Flags of the engine's events: `CU_EVENT_BLOCKING_SYNC` (1), so that
    /// waiting sleeps, and `CU_EVENT_DISABLE_TIMING` (2).
    const EVENT_FLAGS: u32 = 1 | 2;

    /// A stream of one device, owned by one route worker thread, with the
    /// events it records after each batch of copies: its copies run on it
    /// in order, and a batch's event says when it and everything before it
    /// are done.
    struct WorkerStream {
        stream: sys::CUstream,
        /// Events not waited on by anyone (reused).
        free: Vec<sys::CUevent>,
        /// Events made (all back in `free` when the thread ends).
        made: usize,
        lease: ContextLease,
    }

    impl WorkerStream {
        fn new(ordinal: u32) -> Result<Self, CudaError> {
            let lease = ContextLease::retain(ordinal)?;
            let _current = lease.enter()?;
            let mut stream = std::ptr::null_mut();
            // SAFETY: a current context; a valid out-pointer. Flag
            // CU_STREAM_NON_BLOCKING (1): no implicit wait on the legacy
            // default stream of a caller.
            unsafe { check(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate")? };
            drop(_current);
            Ok(WorkerStream { stream, free: Vec::new(), made: 0, lease })
        }

        /// A free event, or a new one (the context is current).
        fn event(&mut self) -> Result<sys::CUevent, CudaError> {
            if let Some(e) = self.free.pop() {
                return Ok(e);
            }
            let mut event = std::ptr::null_mut();
            // SAFETY: a current context; a valid out-pointer.
            check(unsafe { sys::cuEventCreate(&mut event, EVENT_FLAGS) }, "cuEventCreate")?;
            self.made += 1;
            Ok(event)
        }
    }

    impl Drop for WorkerStream {
        fn drop(&mut self) {
            debug_assert_eq!(self.free.len(), self.made, "a ticket outlived its worker");
            if let Ok(_current) = self.lease.enter() {
                // SAFETY: handles made here, destroyed once; the thread
                // waited for every ticket before it ended.
                unsafe {
                    for e in self.free.drain(..) {
                        sys::cuEventDestroy_v2(e);
                    }
                    sys::cuStreamDestroy_v2(self.stream);
                }
            }
        }
    }

    thread_local! {
        /// This thread's streams, by device (made on first use, destroyed
        /// when the thread ends: route workers end at engine shutdown).
        static STREAMS: std::cell::RefCell<Vec<(u32, WorkerStream)>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Destroys this thread's streams and events and gives back their
    /// context references. A route worker calls it as it ends (after its
    /// last ticket): in plain code, not from a thread-local destructor,
    /// where the driver's own per-thread state may already be gone.
    pub(crate) fn release_thread_streams() {
        let streams = STREAMS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
        drop(streams);
    }

    /// Copies queued on this thread's stream of a device, not yet waited
    /// for: [`wait_ticket`] on the same thread says when they are done.
    /// Not `Send` (the stream is the thread's).
    pub(crate) struct Ticket {
        ordinal: u32,
        event: sys::CUevent,
    }

    /// Runs `f` with this thread's stream of `ordinal` (made on first use)
    /// and its context current.
    fn with_stream<T>(ordinal: u32, f: impl FnOnce(&mut WorkerStream) -> Result<T, CudaError>) -> Result<T, CudaError> {
        STREAMS.with(|cell| {
            let mut streams = cell.borrow_mut();
            let at = match streams.iter().position(|(d, _)| *d == ordinal) {
                Some(i) => i,
                None => {
                    streams.push((ordinal, WorkerStream::new(ordinal)?));
                    streams.len() - 1
                }
            };
            let s = &mut streams[at].1;
            let _current = s.lease.enter()?;
            f(s)
        })
    }

    /// Queues `copies` (destination, source, bytes; device or host
    /// addresses, unified addressing) on this thread's stream of device
    /// `ordinal`, in order, and records an event after them. On failure,
    /// what was queued is waited for before this returns: `Err` carries
    /// the bytes of the copies queued before the error, and the error.
    pub(crate) fn issue_on_stream(ordinal: u32, copies: &[(u64, u64, u64)]) -> Result<Ticket, (u64, CudaError)> {
        let issued = with_stream(ordinal, |s| {
            let mut queued = 0u64;
            let mut failed = None;
            for &(dst, src, len) in copies {
                // SAFETY: the caller's ranges are registered device or host
                // memory that its transfer's loans keep alive until the
                // ticket is waited for.
                let r = unsafe { sys::cuMemcpyAsync(dst, src, len as usize, s.stream) };
                if let Err(e) = check(r, "cuMemcpyAsync") {
                    failed = Some(e);
                    break;
                }
                queued += len;
            }
            let recorded = s.event().and_then(|event| {
                // SAFETY: handles of this thread's stream.
                match check(unsafe { sys::cuEventRecord(event, s.stream) }, "cuEventRecord") {
                    Ok(()) => Ok(event),
                    Err(e) => {
                        s.free.push(event);
                        Err(e)
                    }
                }
            });
            // On failure, whatever was queued is done before anyone is told.
            // SAFETY (both syncs): this thread's stream.
            Ok(match (recorded, failed) {
                (Ok(event), None) => Ok(Ticket { ordinal, event }),
                // The copies before the failed one landed.
                (Ok(event), Some(e)) => {
                    unsafe { sys::cuStreamSynchronize(s.stream) };
                    s.free.push(event);
                    Err((queued, e))
                }
                // No event: which copies completed is not known.
                (Err(e), _) => {
                    unsafe { sys::cuStreamSynchronize(s.stream) };
                    Err((0, e))
                }
            })
        });
        issued.unwrap_or_else(|e| Err((0, e)))
    }

    /// Sleeps until the copies of `ticket` (and so every ticket of the
    /// same stream before it) are done, without taking it; errors are left
    /// for [`wait_ticket`].
    pub(crate) fn await_ticket(ticket: &Ticket) {
        let _ = wait_event(ticket.event);
    }

    /// Waits until the copies of `ticket` are done: when this returns, the
    /// device touches none of their ranges any more (also on `Err`: the
    /// stream is then synchronised).
    pub(crate) fn wait_ticket(ticket: Ticket) -> Result<(), CudaError> {
        let Ticket { ordinal, event } = ticket;
        with_stream(ordinal, |s| {
            let r = wait_event(event).inspect_err(|_| {
                // SAFETY: this thread's stream: whatever still runs is done
                // after this.
                unsafe { sys::cuStreamSynchronize(s.stream) };
            });
            s.free.push(event);
            r
        })
    }

    /// Runs `copies` on this thread's stream of device `ordinal` and waits
    /// for them ([`issue_on_stream`], then [`wait_ticket`]). Returns the
    /// bytes of the copies done, and the error that stopped the rest.
    pub(crate) fn copy_on_stream(ordinal: u32, copies: &[(u64, u64, u64)]) -> (u64, Option<CudaError>) {
        match issue_on_stream(ordinal, copies) {
            Ok(ticket) => {
                let bytes = copies.iter().map(|c| c.2).sum();
                match wait_ticket(ticket) {
                    Ok(()) => (bytes, None),
                    Err(e) => (0, Some(e)),
                }
            }
            Err((done, e)) => (done, Some(e)),
        }
    }

    /// Waits until `event` completed: a short spin (a copy that is nearly
    /// done costs no sleep), then the driver's blocking wait, which for an
    /// event made with `CU_EVENT_BLOCKING_SYNC` sleeps until the device
    /// signals it (no polling, whatever the context's spin policy).
    fn wait_event(event: sys::CUevent) -> Result<(), CudaError> {
        for _ in 0..64 {
            // SAFETY: a live event of the caller.
            match unsafe { sys::cuEventQuery(event) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
                other => return Err(CudaError::Copies { code: other as i32, name: name(other) }),
            }
        }
        // SAFETY: as above.
        match unsafe { sys::cuEventSynchronize(event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            other => Err(CudaError::Copies { code: other as i32, name: name(other) }),
        }
    }

    /// A stream of one device with an event per slot: the staging of one
    /// route worker through two buffers of the caller's. Device copies
    /// into or out of a slot's buffer run on the stream; `wait(slot)`
    /// returns once they are done, so the buffer may be reused. Freed on
    /// drop, after waiting for anything still queued.
    pub(crate) struct Stager {
        stream: sys::CUstream,
        events: [sys::CUevent; 2],
        queued: [bool; 2],
        lease: ContextLease,
    }

    impl Stager {
        pub(crate) fn new(ordinal: u32) -> Result<Self, CudaError> {
            let lease = ContextLease::retain(ordinal)?;
            let current = lease.enter()?;
            let mut s =
                Stager { stream: std::ptr::null_mut(), events: [std::ptr::null_mut(); 2], queued: [false; 2], lease };
            // SAFETY: a current context; valid out-pointers. Whatever was
            // made before a failure is freed by `Drop` (null handles are
            // skipped there).
            unsafe {
                check(sys::cuStreamCreate(&mut s.stream, 1), "cuStreamCreate")?;
                for i in 0..2 {
                    check(sys::cuEventCreate(&mut s.events[i], EVENT_FLAGS), "cuEventCreate")?;
                }
            }
            drop(current);
            Ok(s)
        }

        /// Queues `copies` (destination, source, bytes) on the stream and
        /// records slot `slot`'s event after them.
        pub(crate) fn enqueue(&mut self, slot: usize, copies: &[(u64, u64, u64)]) -> Result<(), CudaError> {
            let _current = self.lease.enter()?;
            for &(dst, src, len) in copies {
                // SAFETY: the ranges are registered memory kept alive by the
                // caller's loans, or the caller's buffer, until `wait`.
                check(unsafe { sys::cuMemcpyAsync(dst, src, len as usize, self.stream) }, "cuMemcpyAsync")?;
                self.queued[slot] = true;
            }
            // SAFETY: handles of this stager.
            check(unsafe { sys::cuEventRecord(self.events[slot], self.stream) }, "cuEventRecord")?;
            self.queued[slot] = true;
            Ok(())
        }

        /// Waits for what was queued for slot `slot` (nothing: at once).
        pub(crate) fn wait(&mut self, slot: usize) -> Result<(), CudaError> {
            if !self.queued[slot] {
                return Ok(());
            }
            self.queued[slot] = false;
            wait_event(self.events[slot]).inspect_err(|_| {
                // SAFETY: the stream of this stager; whatever it still runs
                // is done when this returns.
                unsafe { sys::cuStreamSynchronize(self.stream) };
            })
        }

        /// Waits for both slots (after a failure: nothing may still run).
        pub(crate) fn drain(&mut self) {
            let _current = self.lease.enter();
            if !self.stream.is_null() {
                // SAFETY: the stream of this stager.
                unsafe { sys::cuStreamSynchronize(self.stream) };
            }
            self.queued = [false; 2];
        }
    }

    impl Drop for Stager {
        fn drop(&mut self) {
            self.drain();
            if let Ok(_current) = self.lease.enter() {
                // SAFETY: handles made in `new`, destroyed once; the stream
                // is idle (drained above).
                unsafe {
                    for i in 0..2 {
                        if !self.events[i].is_null() {
                            sys::cuEventDestroy_v2(self.events[i]);
                        }
                    }
                    if !self.stream.is_null() {
                        sys::cuStreamDestroy_v2(self.stream);
                    }
                }
            }
        }
    }

    /// A page-locked host buffer (`cuMemHostAlloc` in a device's primary
    /// context), freed on drop.
    pub(crate) struct PinnedBuffer {
        ptr: *mut u8,
        len: u64,
        lease: ContextLease,
    }

    // SAFETY: plain host bytes owned by this value; whoever copies into or
    // out of them holds the buffer (and so the only access) meanwhile.
    unsafe impl Send for PinnedBuffer {}
    // SAFETY: as above; no interior mutability.
    unsafe impl Sync for PinnedBuffer {}

    impl PinnedBuffer {
        pub(crate) fn new(ordinal: u32, len: u64) -> Result<Self, CudaError> {
            let lease = ContextLease::retain(ordinal)?;
            let current = lease.enter()?;
            let mut p = std::ptr::null_mut();
            // SAFETY: a current context; a valid out-pointer.
            check(unsafe { sys::cuMemHostAlloc(&mut p, len as usize, 0) }, "cuMemHostAlloc")?;
            drop(current);
            Ok(PinnedBuffer { ptr: p.cast(), len, lease })
        }

        pub(crate) fn addr(&self) -> u64 {
            self.ptr as u64
        }

        pub(crate) fn len(&self) -> u64 {
            self.len
        }
    }

    impl Drop for PinnedBuffer {
        fn drop(&mut self) {
            if let Ok(_current) = self.lease.enter() {
                // SAFETY: the buffer made in `new`, freed once; its users
                // are done (they held this value).
                unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
            }
        }
    }

    /// Host memory (a registration, or a peer's shared allocation mapped
    /// here) page-locked for the driver the first time a device copy
    /// names it (`cuMemHostRegister`, portable to every context): the
    /// copy engine then reads or writes it directly, where pageable memory
    /// costs the driver a bounce through its own buffers. Pinning is an
    /// optimisation only: memory the driver refuses (already registered
    /// by its owner or by an overlapping registration, or no driver)
    /// stays pageable and copies still work. Unpinned by [`release`],
    /// which the owner calls before the memory goes away.
    ///
    /// [`release`]: HostPin::release
    pub(crate) struct HostPin {
        /// The whole pages holding the range.
        start: u64,
        len: u64,
        /// Set once the one attempt was made (the fast path of `ensure`).
        tried: std::sync::atomic::AtomicBool,
        state: parking_lot::Mutex<PinState>,
    }

    enum PinState {
        Untried,
        Pinned(ContextLease),
        /// Refused (the driver's reason): never tried again.
        Not(CudaError),
        /// Unpinned by `release`: never pinned again.
        Released,
    }

    impl std::fmt::Debug for HostPin {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let state = match &*self.state.lock() {
                PinState::Untried => "not yet pinned".to_owned(),
                PinState::Pinned(_) => "pinned".to_owned(),
                PinState::Not(why) => why.to_string(),
                PinState::Released => "released".to_owned(),
            };
            write!(f, "host range {:#x}+{} ({state})", self.start, self.len)
        }
    }

    impl HostPin {
        /// `addr..addr + len`, widened to whole pages.
        pub(crate) fn new(addr: u64, len: u64) -> Self {
            const PAGE: u64 = 4096;
            let start = addr & !(PAGE - 1);
            let end = addr.saturating_add(len).saturating_add(PAGE - 1) & !(PAGE - 1);
            HostPin {
                start,
                len: end - start,
                tried: std::sync::atomic::AtomicBool::new(false),
                state: parking_lot::Mutex::new(PinState::Untried),
            }
        }

        /// Pins the range the first time (in device `ordinal`'s context;
        /// concurrent callers wait for that one attempt).
        pub(crate) fn ensure(&self, ordinal: u32) {
            use std::sync::atomic::Ordering;
            if self.tried.load(Ordering::Acquire) {
                return;
            }
            let mut state = self.state.lock();
            if matches!(*state, PinState::Untried) {
                *state = match self.pin(ordinal) {
                    Ok(lease) => PinState::Pinned(lease),
                    Err(why) => PinState::Not(why),
                };
            }
            self.tried.store(true, Ordering::Release);
        }

        fn pin(&self, ordinal: u32) -> Result<ContextLease, CudaError> {
            if self.len == 0 {
                return Err(CudaError::Range("an empty host range".into()));
            }
            let lease = ContextLease::retain(ordinal)?;
            let _current = lease.enter()?;
            // SAFETY: whole pages of memory its owner keeps mapped until it
            // calls `release` (before unmapping or freeing it). Flag
            // CU_MEMHOSTREGISTER_PORTABLE (1): pinned for every context.
            let r = unsafe { sys::cuMemHostRegister_v2(self.start as *mut c_void, self.len as usize, 1) };
            check(r, "cuMemHostRegister")?;
            drop(_current);
            Ok(lease)
        }

        /// Unpins the range if it was pinned here; never pinned again.
        /// Called by the owner while the memory is still mapped, after the
        /// last device copy that named it.
        pub(crate) fn release(&self) {
            let mut state = self.state.lock();
            if let PinState::Pinned(lease) = std::mem::replace(&mut *state, PinState::Released) {
                if let Ok(_current) = lease.enter() {
                    // SAFETY: the range registered in `pin`, unregistered
                    // once; no copy names it any more.
                    unsafe { sys::cuMemHostUnregister(self.start as *mut c_void) };
                }
            }
        }
    }

    impl Drop for HostPin {
        fn drop(&mut self) {
            self.release();
        }
    }

    /// Device memory the engine allocated (`cuMemAlloc` in the primary
    /// context); freed on drop, after its last holder.
    pub(crate) struct DeviceAllocation {
        pub ptr: u64,
        pub len: u64,
        pub device: u32,
        pub lease: ContextLease,
    }

    impl DeviceAllocation {
        pub(crate) fn new(ordinal: u32, len: u64) -> Result<Self, CudaError> {
            let lease = ContextLease::retain(ordinal)?;
            let _current = lease.enter()?;
            let mut ptr = 0;
            // SAFETY: a current context; a valid out-pointer.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len as usize) }, "cuMemAlloc")?;
            Ok(DeviceAllocation { ptr, len, device: ordinal, lease })
        }

        /// Copies host bytes into the allocation at `offset` (synchronous).
        pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), CudaError> {
            self.in_bounds(offset, data.len() as u64)?;
            let _current = self.lease.enter()?;
            // SAFETY: in bounds (checked); `data` is live for the call.
            let r = unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset, data.as_ptr().cast(), data.len()) };
            check(r, "cuMemcpyHtoD")
        }

        /// Copies bytes at `offset` into `out` (synchronous).
        pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
            self.in_bounds(offset, out.len() as u64)?;
            let _current = self.lease.enter()?;
            // SAFETY: in bounds (checked); `out` is live and writable.
            let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset, out.len()) };
            check(r, "cuMemcpyDtoH")
        }

        /// `[offset, offset + len)` of the allocation as a dma-buf
        /// descriptor, for a NIC to register (GPUDirect RDMA). Both must be
        /// page aligned.
        #[cfg_attr(not(test), allow(dead_code, reason = "the RDMA route's GPUDirect registration, next"))]
        pub(crate) fn dmabuf(&self, offset: u64, len: u64) -> Result<std::os::fd::OwnedFd, CudaError> {
            self.in_bounds(offset, len)?;
            dmabuf_fd(self.ptr + offset, len)
        }

        fn in_bounds(&self, offset: u64, len: u64) -> Result<(), CudaError> {
            match offset.checked_add(len) {
                Some(end) if end <= self.len => Ok(()),
                _ => Err(CudaError::Range(format!("{offset}+{len} outside device memory of {} bytes", self.len))),
            }
        }
    }

    impl Drop for DeviceAllocation {
        fn drop(&mut self) {
            if let Ok(_current) = self.lease.enter() {
                // SAFETY: the allocation made in `new`, freed once; nothing
                // uses it any more (its holders are gone).
                unsafe { sys::cuMemFree_v2(self.ptr) };
            }
        }
    }

    /// The UUID of device `ordinal` (the same physical device has the same
    /// UUID in every process, whatever its ordinal there).
    fn uuid_of(ordinal: u32) -> Result<[u8; 16], CudaError> {
        let mut device = 0;
        let mut uuid = sys::CUuuid_st { bytes: [0; 16] };
        // SAFETY: valid out-pointers; the driver checks the ordinal.
        unsafe {
            check(sys::cuDeviceGet(&mut device, ordinal as i32), "cuDeviceGet")?;
            check(sys::cuDeviceGetUuid_v2(&mut uuid, device), "cuDeviceGetUuid")?;
        }
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The ordinal in this process of the device with `uuid`, if it is
    /// visible here.
    fn device_by_uuid(uuid: &[u8; 16]) -> Result<Option<u32>, CudaError> {
        let d = driver()?;
        for ordinal in 0..d.info.devices {
            if uuid_of(ordinal)? == *uuid {
                return Ok(Some(ordinal));
            }
        }
        Ok(None)
    }

    /// The allocation of device `ordinal` holding `ptr..ptr + len` as a
    /// dma-buf descriptor (its whole allocation, rounded up to host pages,
    /// as NCCL exports it), and the range's offset in it: what a NIC
    /// registers for GPUDirect RDMA (`ibv_reg_dmabuf_mr`). A range over
    /// several physical allocations of the virtual memory management API
    /// is refused.
    pub(crate) fn dmabuf_of(ordinal: u32, ptr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64), CudaError> {
        let range = validate(ordinal, ptr, len)?;
        if range.chunks > 1 {
            return Err(CudaError::Range(format!(
                "it spans {} physical allocations: a dma-buf export takes one",
                range.chunks
            )));
        }
        let lease = ContextLease::retain(ordinal)?;
        let _current = lease.enter()?;
        let page = 4096u64;
        let fd = dmabuf_fd(range.alloc_base, range.alloc_len.div_ceil(page) * page)?;
        Ok((fd, ptr - range.alloc_base))
    }

    /// `[ptr, ptr + len)` of a live allocation (checked by the caller) as a
    /// dma-buf descriptor.
    fn dmabuf_fd(ptr: u64, len: u64) -> Result<std::os::fd::OwnedFd, CudaError> {
        let mut fd: std::ffi::c_int = -1;
        let kind = sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
        // SAFETY: a range of a live allocation; an int for the descriptor.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange((&mut fd as *mut std::ffi::c_int).cast(), ptr, len as usize, kind, 0)
        };
        check(r, "cuMemGetHandleForAddressRange")?;
        // SAFETY: a fresh descriptor the driver handed over.
        Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
    }

    /// Exports the allocation of device `ordinal` holding `ptr`: as a
    /// legacy CUDA IPC handle, or else (memory of the virtual memory
    /// management API) as a POSIX file descriptor, which the allocation
    /// must have been made to allow (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
    /// among its requested handle types).
    pub(crate) fn ipc_export(ordinal: u32, ptr: u64, len: u64) -> Result<IpcExport, CudaError> {
        let range = validate(ordinal, ptr, len)?;
        if range.chunks > 1 {
            return Err(CudaError::Ipc(format!(
                "it spans {} physical allocations of the virtual memory management API: CUDA IPC takes a registration inside one",
                range.chunks
            )));
        }
        let lease = ContextLease::retain(ordinal)?;
        let _current = lease.enter()?;
        let mut legacy = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: a current context; the start of a live allocation (just
        // checked); a valid out-pointer.
        let handle = match check(unsafe { sys::cuIpcGetMemHandle(&mut legacy, range.alloc_base) }, "cuIpcGetMemHandle")
        {
            Ok(()) => IpcHandle::Legacy(legacy.reserved.map(|b| b as u8)),
            Err(no_legacy) => match export_shareable(range.alloc_base) {
                Ok(fd) => IpcHandle::Shareable(fd),
                Err(no_shareable) => return Err(CudaError::Ipc(format!("{no_legacy}; {no_shareable}"))),
            },
        };
        Ok(IpcExport { handle, uuid: uuid_of(ordinal)?, alloc_base: range.alloc_base, alloc_len: range.alloc_len })
    }

    /// The POSIX file descriptor of the VMM allocation mapped at `base`
    /// (a context is current).
    fn export_shareable(base: u64) -> Result<std::os::fd::OwnedFd, CudaError> {
        use std::os::fd::FromRawFd;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: a valid out-pointer; the driver checks the address.
        let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, base as *mut c_void) };
        check(r, "cuMemRetainAllocationHandle")
            .map_err(|e| CudaError::Ipc(format!("{e} (not memory of cuMemCreate either)")))?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the handle just retained; an int out-value, as the POSIX
        // descriptor type asks.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        // SAFETY: balances the retain above, once.
        unsafe { sys::cuMemRelease(handle) };
        check(r, "cuMemExportToShareableHandle").map_err(|e| {
            CudaError::Ipc(format!(
                "{e} (a cuMemCreate allocation needs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested to be shared)"
            ))
        })?;
        if fd < 0 {
            return Err(CudaError::Ipc("cuMemExportToShareableHandle gave no descriptor".into()));
        }
        // SAFETY: a descriptor the driver just made for this process.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// An imported VMM allocation mapped here, undone in reverse order on
    /// drop as far as it got (the context of `lease` current).
    struct VmmImport {
        handle: sys::CUmemGenericAllocationHandle,
        /// The reservation (0: none yet).
        va: u64,
        len: u64,
        mapped: bool,
    }

    impl VmmImport {
        fn undo(&mut self) {
            // SAFETY: each step undoes one done in `import_shareable`, once;
            // no copy names the mapping any more (its holders are gone).
            unsafe {
                if self.mapped {
                    sys::cuMemUnmap(self.va, self.len as usize);
                    self.mapped = false;
                }
                if self.va != 0 {
                    sys::cuMemAddressFree(self.va, self.len as usize);
                    self.va = 0;
                }
                if self.handle != 0 {
                    sys::cuMemRelease(self.handle);
                    self.handle = 0;
                }
            }
        }
    }

    /// A peer's allocation opened here from its IPC handle, in the primary
    /// context of the same physical device; closed on drop (after the last
    /// copy program that names it), charged to `cuda_imports` meanwhile.
    pub(crate) struct IpcMapping {
        /// Where the allocation is mapped in this process.
        pub ptr: u64,
        /// Its bytes, as this process's driver reports them.
        pub len: u64,
        /// The local ordinal of its device.
        pub device: u32,
        /// Imported from a shareable handle (else opened from a legacy one).
        vmm: Option<VmmImport>,
        lease: ContextLease,
        _charge: crate::charge::Charge,
    }

    impl std::fmt::Debug for IpcMapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "IPC mapping of device {} at {:#x}+{}", self.device, self.ptr, self.len)
        }
    }

    impl IpcMapping {
        /// Opens `handle` on the device with `uuid`. The mapping's extent is
        /// what this driver reports for it (never what the peer said).
        pub(crate) fn open(
            handle: &[u8; 64],
            uuid: &[u8; 16],
            counters: &std::sync::Arc<crate::charge::Counters>,
        ) -> Result<Self, CudaError> {
            let device = device_by_uuid(uuid)?.ok_or(CudaError::DeviceNotVisible)?;
            let lease = ContextLease::retain(device)?;
            let current = lease.enter()?;
            let h = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
            let mut ptr = 0;
            // SAFETY: a current context; the handle is 64 opaque bytes the
            // driver checks; a valid out-pointer. Flag 1: peer access is
            // enabled lazily where the devices differ.
            let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, 1) };
            check(r, "cuIpcOpenMemHandle")?;
            drop(current);
            let _charge = crate::charge::Charge::unlimited(counters, crate::charge::Counter::CudaImports, 1);
            let mut m = IpcMapping { ptr, len: 0, device, vmm: None, lease, _charge };
            // The local proof of the mapping's extent.
            let range = validate(device, ptr, 1)?;
            if range.alloc_base != ptr {
                return Err(CudaError::Ipc(format!("the IPC mapping at {ptr:#x} does not start its allocation")));
            }
            m.len = range.alloc_len;
            Ok(m)
        }

        /// Imports a VMM allocation of `alloc_len` bytes from its POSIX file
        /// descriptor (`fd`, closed here) on the device with `uuid`: the
        /// handle, a reservation of that many bytes, the mapping, read and
        /// write access for the device. The mapping's extent is then what
        /// this driver reports for it (never what the peer said).
        pub(crate) fn import_shareable(
            fd: std::os::fd::OwnedFd,
            uuid: &[u8; 16],
            alloc_len: u64,
            counters: &std::sync::Arc<crate::charge::Counters>,
        ) -> Result<Self, CudaError> {
            use std::os::fd::AsRawFd;
            let device = device_by_uuid(uuid)?.ok_or(CudaError::DeviceNotVisible)?;
            let lease = ContextLease::retain(device)?;
            let current = lease.enter()?;
            let location =
                sys::CUmemLocation_st { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device as i32 };
            // SAFETY: a plain C struct, all zeros is a valid value for it.
            let mut prop: sys::CUmemAllocationProp_st = unsafe { std::mem::zeroed() };
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location = location;
            let mut granularity = 0usize;
            // SAFETY: valid in- and out-pointers.
            check(
                unsafe {
                    sys::cuMemGetAllocationGranularity(
                        &mut granularity,
                        &prop,
                        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    )
                },
                "cuMemGetAllocationGranularity",
            )?;
            if alloc_len == 0 || granularity == 0 || alloc_len % granularity as u64 != 0 {
                return Err(CudaError::Ipc(format!(
                    "the peer's allocation of {alloc_len} bytes is no multiple of the granularity {granularity}"
                )));
            }
            let mut v = VmmImport { handle: 0, va: 0, len: alloc_len, mapped: false };
            let done = (|| {
                // SAFETY: the descriptor stays open for the call (the driver
                // keeps what it needs); a valid out-pointer.
                check(
                    unsafe {
                        sys::cuMemImportFromShareableHandle(
                            &mut v.handle,
                            fd.as_raw_fd() as usize as *mut c_void,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        )
                    },
                    "cuMemImportFromShareableHandle",
                )?;
                // SAFETY: a valid out-pointer; size checked above.
                check(
                    unsafe { sys::cuMemAddressReserve(&mut v.va, alloc_len as usize, 0, 0, 0) },
                    "cuMemAddressReserve",
                )?;
                // SAFETY: the whole fresh reservation, the imported handle;
                // the driver refuses a size beyond the allocation.
                check(unsafe { sys::cuMemMap(v.va, alloc_len as usize, 0, v.handle, 0) }, "cuMemMap")?;
                v.mapped = true;
                let access = sys::CUmemAccessDesc_st {
                    location,
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                // SAFETY: the mapping just made; one valid descriptor.
                check(unsafe { sys::cuMemSetAccess(v.va, alloc_len as usize, &access, 1) }, "cuMemSetAccess")
            })();
            drop(fd);
            if let Err(e) = done {
                v.undo();
                return Err(e);
            }
            drop(current);
            let ptr = v.va;
            let _charge = crate::charge::Charge::unlimited(counters, crate::charge::Counter::CudaImports, 1);
            let m = IpcMapping { ptr, len: alloc_len, device, vmm: Some(v), lease, _charge };
            // The local proof of the mapping's extent.
            let range = validate(device, ptr, 1)?;
            if range.alloc_base != ptr || range.alloc_len != alloc_len {
                return Err(CudaError::Ipc(format!(
                    "the driver reports the imported mapping at {ptr:#x}+{alloc_len} as {:#x}+{}",
                    range.alloc_base, range.alloc_len
                )));
            }
            Ok(m)
        }
    }

    impl Drop for IpcMapping {
        fn drop(&mut self) {
            if let Ok(_current) = self.lease.enter() {
                match &mut self.vmm {
                    Some(v) => v.undo(),
                    // SAFETY: the mapping opened in `open`, closed once; no
                    // copy names it any more (they held this value).
                    None => unsafe {
                        sys::cuIpcCloseMemHandle(self.ptr);
                    },
                }
            }
        }
    }
}

/// The driver's interface without feature `cuda`: the same types and
/// calls, so that nothing above this module needs the feature. Nothing
/// here can be made: every constructor and call answers
/// [`CudaError::NotBuilt`], and the types that stand for driver objects
/// are uninhabited (a host page-lock record is the one exception: it
/// never pins).
#[cfg(not(feature = "cuda"))]
mod driver {
    use std::convert::Infallible;

    use super::{CudaError, DeviceRange, IpcExport};

    pub(crate) struct ContextLease {
        never: Infallible,
    }

    impl ContextLease {
        pub(crate) fn retain(_ordinal: u32) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub(crate) fn device(&self) -> u32 {
            match self.never {}
        }
    }

    pub(crate) struct Ticket {
        never: Infallible,
    }

    pub(crate) fn validate(_ordinal: u32, _ptr: u64, _len: u64) -> Result<DeviceRange, CudaError> {
        Err(CudaError::NotBuilt)
    }

    pub(crate) fn release_thread_streams() {}

    pub(crate) fn pci_bus_id(_ordinal: u32) -> Result<String, CudaError> {
        Err(CudaError::NotBuilt)
    }

    pub(crate) fn issue_on_stream(_ordinal: u32, _copies: &[(u64, u64, u64)]) -> Result<Ticket, (u64, CudaError)> {
        Err((0, CudaError::NotBuilt))
    }

    pub(crate) fn await_ticket(ticket: &Ticket) {
        match ticket.never {}
    }

    pub(crate) fn wait_ticket(ticket: Ticket) -> Result<(), CudaError> {
        match ticket.never {}
    }

    pub(crate) fn copy_on_stream(_ordinal: u32, _copies: &[(u64, u64, u64)]) -> (u64, Option<CudaError>) {
        (0, Some(CudaError::NotBuilt))
    }

    pub(crate) struct Stager {
        never: Infallible,
    }

    impl Stager {
        pub(crate) fn new(_ordinal: u32) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub(crate) fn enqueue(&mut self, _slot: usize, _copies: &[(u64, u64, u64)]) -> Result<(), CudaError> {
            match self.never {}
        }
        pub(crate) fn wait(&mut self, _slot: usize) -> Result<(), CudaError> {
            match self.never {}
        }
        pub(crate) fn drain(&mut self) {
            match self.never {}
        }
    }

    pub(crate) struct PinnedBuffer {
        never: Infallible,
    }

    impl PinnedBuffer {
        pub(crate) fn new(_ordinal: u32, _len: u64) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub(crate) fn addr(&self) -> u64 {
            match self.never {}
        }
        pub(crate) fn len(&self) -> u64 {
            match self.never {}
        }
    }

    /// A host range that is never pinned (no driver).
    #[derive(Debug)]
    pub(crate) struct HostPin;

    impl HostPin {
        pub(crate) fn new(_addr: u64, _len: u64) -> Self {
            HostPin
        }
        pub(crate) fn ensure(&self, _ordinal: u32) {}
        pub(crate) fn release(&self) {}
    }

    pub(crate) struct DeviceAllocation {
        pub ptr: u64,
        pub len: u64,
        pub device: u32,
        pub lease: ContextLease,
    }

    impl DeviceAllocation {
        pub(crate) fn new(_ordinal: u32, _len: u64) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub(crate) fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), CudaError> {
            match self.lease.never {}
        }
        pub(crate) fn read(&self, _offset: u64, _out: &mut [u8]) -> Result<(), CudaError> {
            match self.lease.never {}
        }
        #[cfg_attr(not(test), allow(dead_code, reason = "the RDMA route's GPUDirect registration, next"))]
        pub(crate) fn dmabuf(&self, _offset: u64, _len: u64) -> Result<std::os::fd::OwnedFd, CudaError> {
            match self.lease.never {}
        }
    }

    pub(crate) fn dmabuf_of(_ordinal: u32, _ptr: u64, _len: u64) -> Result<(std::os::fd::OwnedFd, u64), CudaError> {
        Err(CudaError::NotBuilt)
    }

    pub(crate) fn ipc_export(_ordinal: u32, _ptr: u64, _len: u64) -> Result<IpcExport, CudaError> {
        Err(CudaError::NotBuilt)
    }

    #[derive(Debug)]
    pub(crate) struct IpcMapping {
        pub ptr: u64,
        pub len: u64,
        pub device: u32,
        never: Infallible,
    }

    impl IpcMapping {
        pub(crate) fn open(
            _handle: &[u8; 64],
            _uuid: &[u8; 16],
            _counters: &std::sync::Arc<crate::charge::Counters>,
        ) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub(crate) fn import_shareable(
            _fd: std::os::fd::OwnedFd,
            _uuid: &[u8; 16],
            _alloc_len: u64,
            _counters: &std::sync::Arc<crate::charge::Counters>,
        ) -> Result<Self, CudaError> {
            Err(CudaError::NotBuilt)
        }
        #[allow(dead_code, reason = "the feature's mapping has it")]
        fn unreachable(&self) -> ! {
            match self.never {}
        }
    }
}
