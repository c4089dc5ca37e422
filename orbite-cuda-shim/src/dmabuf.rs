//! `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`:
//! what GPUDirect RDMA registers with a NIC (`ibv_reg_dmabuf_mr`).
//!
//! A device allocation here is a memfd; the handle is a new open file
//! description of it (so closing it never closes the allocation's), its
//! file position set to where the range starts in the memfd. The test
//! verbs library maps the handle from that position, as a NIC maps a
//! dma-buf, so RDMA reaches device memory without the process touching
//! the device address. A real dma-buf starts at position 0: the same rule
//! reads it right.

use std::ffi::{c_int, c_ulonglong, c_void};
use std::os::fd::AsRawFd;

use crate::ffi::*;
use crate::memory::{Backing, TABLE, find, page_size};

/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const DMA_BUF_FD: c_int = 1;
/// `CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE`.
const MAPPING_TYPE_PCIE: c_ulonglong = 1;

/// Exports `[dptr, dptr + size)` of one device allocation as a dma-buf
/// descriptor written to `*handle` (an int). Both must be page aligned,
/// the range inside one `cuMemAlloc` allocation: `CUDA_ERROR_INVALID_VALUE`
/// otherwise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    dptr: CUdeviceptr,
    size: usize,
    handle_type: c_int,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        crate::init::config()?;
        let page = page_size();
        let (addr, len) = (dptr as usize, size);
        if handle.is_null()
            || handle_type != DMA_BUF_FD
            || flags & !MAPPING_TYPE_PCIE != 0
            || len == 0
            || addr % page != 0
            || len % page != 0
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        let region = find(&table, addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let Backing::Alloc(mapping) = &region.backing else { return Err(CUDA_ERROR_INVALID_VALUE) };
        if addr.checked_add(len).is_none_or(|end| end > region.end()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", mapping.fd.as_raw_fd()))
            .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        // SAFETY: a NUL-terminated path of this process's own memfd.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: the descriptor opened above.
        if unsafe { libc::lseek(fd, (addr - region.base) as libc::off_t, libc::SEEK_SET) } < 0 {
            // SAFETY: as above; not handed out.
            unsafe { libc::close(fd) };
            return Err(CUDA_ERROR_UNKNOWN);
        }
        // SAFETY: `handle` points to an int (the driver API's contract).
        unsafe { *(handle as *mut c_int) = fd };
        Ok(())
    })
}
