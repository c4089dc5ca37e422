//! The NIXL plugin's own C++ parsers (nixl-plugin/orbite_backend.cpp),
//! reached through `cxx/plugin_shim.cpp` when build.rs found a NIXL source
//! tree to compile them against. Every wrapper returns `None` when they
//! were not built.

/// True when the plugin's parsers are part of this build.
pub const AVAILABLE: bool = cfg!(orbite_fuzz_plugin);

#[cfg(orbite_fuzz_plugin)]
mod ffi {
    use std::ffi::c_char;

    unsafe extern "C" {
        pub fn orbite_fuzz_peer_epoch(info: *const c_char, len: usize, epoch: *mut u64) -> i32;
        pub fn orbite_fuzz_unwrap_notification(
            bytes: *const c_char,
            len: usize,
            agent_len: *mut usize,
            payload_len: *mut usize,
        ) -> i32;
        pub fn orbite_fuzz_wrap_notification(
            agent: *const c_char,
            agent_len: usize,
            payload: *const c_char,
            payload_len: usize,
            out: *mut c_char,
            cap: usize,
        ) -> usize;
        #[allow(clippy::too_many_arguments)]
        pub fn orbite_fuzz_add_default(
            json: *const c_char,
            len: usize,
            key: *const c_char,
            key_len: usize,
            value: *const c_char,
            value_len: usize,
            out: *mut c_char,
            cap: usize,
            out_len: *mut usize,
        ) -> i32;
    }
}

/// What the plugin makes of a call: a result, or an exception it threw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The parser returned.
    Returned(T),
    /// A C++ exception escaped the parser (caught in the shim).
    Threw,
}

/// The plugin's `peerEpoch`: the epoch it reads from peer information, or
/// `None` inside when it refuses the bytes.
pub fn peer_epoch(info: &[u8]) -> Option<Outcome<Option<u64>>> {
    #[cfg(orbite_fuzz_plugin)]
    {
        let mut epoch = 0u64;
        // SAFETY: `info` is readable for its length and `epoch` writable;
        // the shim copies the bytes before parsing them.
        let r = unsafe { ffi::orbite_fuzz_peer_epoch(info.as_ptr().cast(), info.len(), &mut epoch) };
        Some(match r {
            1 => Outcome::Returned(Some(epoch)),
            0 => Outcome::Returned(None),
            _ => Outcome::Threw,
        })
    }
    #[cfg(not(orbite_fuzz_plugin))]
    {
        let _ = info;
        None
    }
}

/// The plugin's `unwrapNotification`: the agent name's and the payload's
/// lengths, or `None` inside when it refuses the bytes.
pub fn unwrap_notification(bytes: &[u8]) -> Option<Outcome<Option<(usize, usize)>>> {
    #[cfg(orbite_fuzz_plugin)]
    {
        let (mut agent, mut payload) = (0usize, 0usize);
        // SAFETY: `bytes` is readable for its length, the two outputs are
        // writable.
        let r = unsafe {
            ffi::orbite_fuzz_unwrap_notification(bytes.as_ptr().cast(), bytes.len(), &mut agent, &mut payload)
        };
        Some(match r {
            1 => Outcome::Returned(Some((agent, payload))),
            0 => Outcome::Returned(None),
            _ => Outcome::Threw,
        })
    }
    #[cfg(not(orbite_fuzz_plugin))]
    {
        let _ = bytes;
        None
    }
}

/// The plugin's `wrapNotification` of (agent, payload).
pub fn wrap_notification(agent: &[u8], payload: &[u8]) -> Option<Vec<u8>> {
    #[cfg(orbite_fuzz_plugin)]
    {
        let mut out = vec![0u8; 6 + agent.len() + payload.len()];
        // SAFETY: both inputs readable for their lengths, `out` writable
        // for its length, which bounds what the shim writes.
        let n = unsafe {
            ffi::orbite_fuzz_wrap_notification(
                agent.as_ptr().cast(),
                agent.len(),
                payload.as_ptr().cast(),
                payload.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        out.truncate(n.min(out.len()));
        Some(out)
    }
    #[cfg(not(orbite_fuzz_plugin))]
    {
        let _ = (agent, payload);
        None
    }
}

/// The plugin's `addDefault(json, key, value, {})`: the document it would
/// pass on, or `None` inside when it refuses the document.
pub fn add_default(json: &[u8], key: &str, value: &str) -> Option<Outcome<Option<Vec<u8>>>> {
    #[cfg(orbite_fuzz_plugin)]
    {
        let mut out = vec![0u8; json.len() + key.len() + value.len() + 16];
        let mut n = 0usize;
        // SAFETY: the inputs are readable for their lengths, `out`
        // writable for its length (which bounds the copy), `n` writable.
        let r = unsafe {
            ffi::orbite_fuzz_add_default(
                json.as_ptr().cast(),
                json.len(),
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr().cast(),
                value.len(),
                out.as_mut_ptr().cast(),
                out.len(),
                &mut n,
            )
        };
        Some(match r {
            1 => {
                assert!(n <= out.len(), "addDefault grew the document by more than the key and value");
                out.truncate(n);
                Outcome::Returned(Some(out))
            }
            0 => Outcome::Returned(None),
            _ => Outcome::Threw,
        })
    }
    #[cfg(not(orbite_fuzz_plugin))]
    {
        let _ = (json, key, value);
        None
    }
}
