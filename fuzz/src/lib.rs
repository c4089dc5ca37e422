//! The bodies of OrbiTE's fuzz targets, one module each, and the seed
//! inputs they start from.
//!
//! Every `run` takes untrusted bytes and must return normally: a panic, an
//! abort, a hang or an allocation beyond [`MAX_ALLOCATION`] is a finding.
//! Besides "never crash", each target checks what its code promises:
//! decode/encode round trips, a protocol machine's replies that do not
//! depend on how its input was cut, a ring that hands back exactly what was
//! appended, an ABI whose every call returns a status and whose charges go
//! back to zero once every handle is released.
//!
//! Each module's `seeds` builds valid inputs with the crates' own encoders,
//! so that `examples/seeds.rs` can write the corpora again after a format
//! change.

pub mod abi;
pub mod config;
pub mod inbox;
pub mod input;
pub mod metadata;
pub mod notify;
pub mod plugin;
pub mod segment;
pub mod server;
pub mod wire;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::OnceLock;

/// Prints what a target does, with `ORBITE_FUZZ_TRACE` set (replaying a
/// finding with the replay example or the fuzz binary).
pub fn trace(what: std::fmt::Arguments<'_>) {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("ORBITE_FUZZ_TRACE").is_some()) {
        eprintln!("trace: {what}");
    }
}

/// Largest single allocation a target may make. Inputs are a few KiB, and
/// every length the code reads is meant to be bounded before it allocates:
/// anything larger is a finding (libFuzzer's own allocation limit needs a
/// sanitizer's malloc hooks, which a stable toolchain does not build).
pub const MAX_ALLOCATION: usize = 128 << 20;

/// The system allocator, with the bound above.
struct Bounded;

fn check(size: usize) {
    if size > MAX_ALLOCATION {
        // No allocation while reporting one: a fixed message, the size in
        // a stack buffer.
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = size;
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        let mut err = std::io::stderr();
        let _ = err.write_all(b"orbite-fuzz: an allocation of ");
        let _ = err.write_all(&digits[at..]);
        let _ = err.write_all(b" bytes exceeds the fuzz bound\n");
        std::process::abort();
    }
}

// SAFETY: every call is passed to the system allocator unchanged; the
// bound only aborts before a call.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from System) with
        // `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        // SAFETY: as for dealloc, and the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Bounded = Bounded;
