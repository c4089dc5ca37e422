//! The LP64 layout of every record, as Rust lays it out, must equal the
//! numbers the C test (test/c/layout.c) asserts statically; both sides read
//! them from test/c/layout.expected.

use std::collections::BTreeSet;
use std::mem::offset_of;

use orbite_nixl::*;

macro_rules! layout {
    ($out:ident, $t:ident { $($f:ident),* $(,)? }) => {
        $out.insert(format!("{} size {}", stringify!($t), size_of::<$t>()));
        $($out.insert(format!("{}.{} {}", stringify!($t), stringify!($f), offset_of!($t, $f)));)*
    };
}

fn rust_layout() -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    layout!(s, OrbiteEngine { raw });
    layout!(s, OrbiteRegistration { raw });
    layout!(s, OrbiteShm { raw });
    layout!(s, OrbitePeer { raw });
    layout!(s, OrbiteXfer { raw });
    layout!(s, OrbiteFile { raw });
    layout!(
        s,
        OrbiteFileInfo {
            size,
            version,
            mode,
            closed,
            len,
            dev,
            ino,
            st_mode,
            flags,
            mtime_sec,
            mtime_nsec,
            dio_mem_align,
            dio_offset_align,
            reserved
        }
    );
    layout!(
        s,
        OrbiteAbiInfo {
            size,
            version,
            abi_major,
            abi_minor,
            features,
            engine_options_size,
            mem_region_size,
            desc_size,
            xfer_spec_size,
            xfer_state_size,
            remote_range_size,
            close_report_size,
            stats_size,
            drain_result_size,
            notif_view_size,
        }
    );
    layout!(
        s,
        OrbiteEngineOptions { size, version, abi_major, flags, required_features, config_json, config_json_len }
    );
    layout!(
        s,
        OrbiteMemRegion { size, version, addr, len, kind, device, permission, reserved, release, release_context }
    );
    layout!(s, OrbiteDesc { registration, offset, len });
    layout!(
        s,
        OrbiteXferSpec {
            size,
            version,
            op,
            intent,
            route,
            flags,
            deadline_us,
            peer,
            local,
            local_count,
            remote,
            remote_count,
            notification,
            notification_len,
        }
    );
    layout!(
        s,
        OrbiteXferState {
            size,
            version,
            state,
            phase,
            code,
            remote_effect,
            drained,
            route,
            transferred_bytes,
            transferred_prefix,
            total_bytes,
            execution,
            tasks_started,
            tasks_never_started,
        }
    );
    layout!(s, OrbiteRemoteRange { size, version, remote_registration, addr, len, permission, shared });
    layout!(s, OrbiteCloseReport { size, version, drained, reserved, unquiesced });
    layout!(
        s,
        OrbiteStats {
            size,
            version,
            registrations,
            registered_bytes,
            fenced_registrations,
            host_allocations,
            host_memory_bytes,
            prepared_transfers,
            executions,
            queued_executions,
            bytes_in_flight,
            tasks_in_flight,
            unquiesced_owners,
            notification_bytes,
            binding_handles,
            pinned_ranges,
            auth_failures,
            device_allocations,
            device_memory_bytes,
            staging_buffers,
            staging_bytes,
            cuda_imports,
            connections,
            connections_refused,
            frame_buffer_bytes,
            borrows,
            borrow_bytes,
            watchers,
        }
    );
    layout!(s, OrbiteDrainResult { size, version, count, written, next_needed });
    layout!(s, OrbiteNotifView { size, version, sender_epoch, sender, sender_len, payload, payload_len });
    s
}

#[test]
#[cfg(all(target_pointer_width = "64", target_os = "linux"))]
fn rust_and_c_agree_on_every_record_layout() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../test/c/layout.expected");
    let text = std::fs::read_to_string(path).expect("test/c/layout.expected");
    let c: BTreeSet<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    let rust = rust_layout();
    let only_rust: Vec<_> = rust.difference(&c).collect();
    let only_c: Vec<_> = c.difference(&rust).collect();
    assert!(only_rust.is_empty() && only_c.is_empty(), "Rust only: {only_rust:#?}\nC test only: {only_c:#?}");
}

/// Counters of `orbite_core::Stats` that `OrbiteStats` does not carry:
/// adding one changes the C ABI (a new record version).
const NOT_IN_THE_RECORD: &[&str] = &[];

#[test]
fn the_stats_record_has_every_counter_of_the_core_in_its_order() {
    // The fields of OrbiteStats by offset, as laid out (offset_of! above).
    let mut fields: Vec<(usize, String)> = rust_layout()
        .iter()
        .filter_map(|l| l.strip_prefix("OrbiteStats."))
        .map(|l| {
            let (name, offset) = l.split_once(' ').unwrap();
            (offset.parse().unwrap(), name.to_owned())
        })
        .collect();
    fields.sort();
    let names: Vec<&str> = fields.iter().map(|(_, n)| n.as_str()).collect();
    let counters: Vec<&str> =
        orbite_core::Stats::FIELDS.iter().copied().filter(|n| !NOT_IN_THE_RECORD.contains(n)).collect();
    assert_eq!(names[..2], ["size", "version"]);
    assert_eq!(names[2..], counters, "OrbiteStats must carry the counters of Stats, by name, in order");
    // Nothing else: two u32, then one u64 per counter.
    assert_eq!(size_of::<OrbiteStats>(), 8 + 8 * counters.len());
    for (i, (offset, name)) in fields.iter().skip(2).enumerate() {
        assert_eq!(*offset, 8 + 8 * i, "{name}");
    }
}
