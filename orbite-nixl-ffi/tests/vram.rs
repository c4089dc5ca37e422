//! `ORBITE_MEM_VRAM` through the C ABI (feature `cuda`): a device range the
//! driver vouches for is registered and holds its context until
//! deregistered; a host pointer, another device's ordinal or a range past
//! its allocation is refused with the charges unchanged. Needs a driver
//! (the test shim in CI: `scripts/cuda-shim`); without one, VRAM is
//! NOT_SUPPORTED and the message names what is missing.
#![cfg(feature = "cuda")]

use orbite_nixl::*;

fn last_error() -> String {
    let mut needed = 0usize;
    // SAFETY: a size query with a valid out-pointer.
    let _ = unsafe { orbite_last_error(std::ptr::null_mut(), 0, &mut needed) };
    let mut buf = vec![0u8; needed.max(1)];
    // SAFETY: `buf` holds `needed` bytes.
    let _ = unsafe { orbite_last_error(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    String::from_utf8_lossy(&buf[..needed.saturating_sub(1)]).into_owned()
}

fn engine() -> OrbiteEngine {
    let json = "{}";
    let o = OrbiteEngineOptions {
        size: size_of::<OrbiteEngineOptions>() as u32,
        version: ORBITE_RECORD_VERSION,
        abi_major: ORBITE_ABI_MAJOR,
        flags: 0,
        required_features: 0,
        config_json: json.as_ptr(),
        config_json_len: json.len() as u64,
    };
    let mut e = OrbiteEngine::default();
    // SAFETY: valid records.
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::Ok);
    e
}

fn stats(e: OrbiteEngine) -> OrbiteStats {
    let mut s = OrbiteStats { size: size_of::<OrbiteStats>() as u32, version: 1, ..Default::default() };
    // SAFETY: a valid record.
    assert_eq!(unsafe { orbite_engine_stats(e, &mut s) }, OrbiteStatus::Ok);
    s
}

fn vram(device: u32, addr: u64, len: u64) -> OrbiteMemRegion {
    OrbiteMemRegion {
        size: size_of::<OrbiteMemRegion>() as u32,
        version: ORBITE_RECORD_VERSION,
        addr,
        len,
        kind: ORBITE_MEM_VRAM,
        device,
        permission: ORBITE_PERM_REMOTE_READ_WRITE,
        reserved: 0,
        release: None,
        release_context: std::ptr::null_mut(),
    }
}

fn register(e: OrbiteEngine, r: &OrbiteMemRegion) -> (OrbiteStatus, OrbiteRegistration) {
    let mut out = OrbiteRegistration::default();
    // SAFETY: valid records; the device range outlives the registration.
    let s = unsafe { orbite_mem_register(e, r, &mut out) };
    (s, out)
}

#[test]
fn vram_registrations_are_checked_by_the_driver() {
    let e = engine();
    let base = stats(e);
    let mut abi = OrbiteAbiInfo { size: size_of::<OrbiteAbiInfo>() as u32, version: 1, ..Default::default() };
    // SAFETY: a valid record.
    assert_eq!(unsafe { orbite_abi_info(&mut abi) }, OrbiteStatus::Ok);
    assert_eq!(abi.features & ORBITE_FEATURE_VRAM != 0, orbite_core::cuda::availability().is_ok());
    let Ok(info) = orbite_core::cuda::availability() else {
        let (s, _) = register(e, &vram(0, 0x10000, 4096));
        assert_eq!(s, OrbiteStatus::NotSupported);
        let why = last_error();
        assert!(why.contains("VRAM is not available"), "{why}");
        println!("SKIP: {why}");
        assert_eq!(stats(e), base);
        return;
    };
    // Device memory from an engine of the core (the C ABI has no allocator).
    let core = orbite_core::TransferEngine::new(orbite_core::EngineConfig::default()).unwrap();
    let m = core.allocate_cuda_memory(0, 1 << 20).unwrap();
    let p = m.device_ptr();
    let (s, r) = register(e, &vram(0, p + 4096, 65536));
    assert_eq!(s, OrbiteStatus::Ok, "{}", last_error());
    let with = stats(e);
    assert_eq!((with.registrations, with.registered_bytes), (base.registrations + 1, base.registered_bytes + 65536));
    let host = vec![0u8; 4096];
    for (region, what) in [
        (vram(0, host.as_ptr() as u64, 4096), "not CUDA device memory"),
        (vram(0, p + (1 << 20) - 100, 200), "crosses its allocation"),
        (vram(info.devices, p, 4096), "device"),
    ] {
        let (s, _) = register(e, &region);
        assert_ne!(s, OrbiteStatus::Ok, "{what}");
        let why = last_error();
        assert!(why.contains(what), "{why} should say {what}");
        assert_eq!(stats(e), with, "a refusal charges nothing");
    }
    let mut bad = vram(0, p, 4096);
    bad.reserved = 1;
    assert_eq!(register(e, &bad).0, OrbiteStatus::InvalidArgument);
    assert_eq!(orbite_mem_deregister(r), OrbiteStatus::Ok);
    assert_eq!(stats(e), base, "charges back to baseline");
    drop(m);
    let mut report =
        OrbiteCloseReport { size: size_of::<OrbiteCloseReport>() as u32, version: 1, ..Default::default() };
    // SAFETY: a valid record.
    assert_eq!(unsafe { orbite_engine_close(e, 5000, &mut report) }, OrbiteStatus::Ok);
    assert_eq!(orbite_engine_release(e), OrbiteStatus::Ok);
}
