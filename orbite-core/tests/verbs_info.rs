//! RDMA NICs as `orbite info` reports them, through the verbs library
//! loader against the test verbs library (`orbite-verbs-shim`,
//! `scripts/verbs-shim`), described per run: devices, ports, link layers,
//! GID tables and their default, NUMA nodes from a fake sysfs root; and
//! the reasons when there is none (no library, a library without the
//! verbs, no device, a description that does not parse).
//!
//! The shim is found at `ORBITE_VERBS_SHIM` or in this workspace's
//! `target/debug`; without it these tests print SKIP, unless
//! `ORBITE_VERBS_REQUIRED` is set (the test command sets it).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn shim() -> Option<PathBuf> {
    let path = std::env::var_os("ORBITE_VERBS_SHIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/liborbite_verbs_shim.so"));
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("ORBITE_VERBS_REQUIRED").is_none(),
        "ORBITE_VERBS_REQUIRED: no verbs shim at {}",
        path.display()
    );
    println!("SKIP: no verbs shim at {} (scripts/verbs-shim builds it)", path.display());
    None
}

/// `orbite info --json`'s `rdma` object with these variables set.
fn rdma(env: &[(&str, &str)]) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_orbite"));
    cmd.args(["info", "--json", "--config", r#"{"listen": "127.0.0.1:0"}"#]);
    cmd.env_remove("ORBITE_VERBS_SHIM_DEVICES").env_remove("ORBITE_SYSFS_ROOT").env_remove("ORBITE_CONFIG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("orbite runs");
    assert!(out.status.success(), "orbite info failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    v["rdma"].clone()
}

#[test]
fn the_default_shim_device_has_one_active_roce_port_and_prefers_its_ipv4_roce_v2_gid() {
    let Some(shim) = shim() else { return };
    let r = rdma(&[("ORBITE_IBVERBS_LIB", shim.to_str().unwrap())]);
    assert_eq!(r["reason"], Value::Null, "{r}");
    let nics = r["nics"].as_array().unwrap();
    assert_eq!(nics.len(), 1);
    assert_eq!(nics[0]["name"], "shim0");
    assert_eq!(nics[0]["firmware"], "orbite-verbs-shim 1");
    let port = &nics[0]["ports"][0];
    assert_eq!((port["port"].as_u64(), port["state"].as_str()), (Some(1), Some("active")));
    assert_eq!((port["link_layer"].as_str(), port["active_mtu"].as_u64()), (Some("ethernet"), Some(4096)));
    assert_eq!(port["gids"][1]["gid"], "::ffff:127.0.0.1");
    assert_eq!(port["gids"][1]["type"], "roce-v2");
    assert_eq!(port["gids"][1]["netdev"], "lo");
    assert_eq!(port["default_gid"], 1, "RoCE v2 over IPv4 before a link-local RoCE v1 GID");
}

#[test]
fn described_devices_ports_and_gids_are_reported_with_numa_nodes_from_sysfs() {
    let Some(shim) = shim() else { return };
    let sysfs = std::env::temp_dir().join(format!("orbite-verbs-sysfs-{}", std::process::id()));
    let node = sysfs.join("class/infiniband/mlx5_1/device");
    std::fs::create_dir_all(&node).unwrap();
    std::fs::write(node.join("numa_node"), "1\n").unwrap();
    let devices = r#"[
        {"name": "mlx5_0", "guid": "0x0002c90300a1b2c3", "ports": [
            {"state": "active", "link_layer": "infiniband", "mtu": 4096,
             "gids": [{"gid": "fe80::2:c903:a1:b2c3", "type": "ib"}]}]},
        {"name": "mlx5_1", "ports": [
            {"state": "down", "mtu": 1024, "gids": [
                {"gid": "fe80::1", "type": "roce-v1"},
                {"gid": "fe80::1", "type": "roce-v2"},
                {"gid": "2001:db8::7", "type": "roce-v2"},
                {"gid": "::ffff:10.1.2.3", "type": "roce-v1"},
                {"gid": "::ffff:10.1.2.3", "type": "roce-v2"}]},
            {"state": "active", "gids": []}]}]"#;
    let r = rdma(&[
        ("ORBITE_IBVERBS_LIB", shim.to_str().unwrap()),
        ("ORBITE_VERBS_SHIM_DEVICES", devices),
        ("ORBITE_SYSFS_ROOT", sysfs.to_str().unwrap()),
    ]);
    std::fs::remove_dir_all(&sysfs).unwrap();
    let nics = r["nics"].as_array().unwrap();
    assert_eq!(nics.len(), 2, "{r}");
    assert_eq!((nics[0]["guid"].as_str(), nics[0]["numa_node"].as_u64()), (Some("0x0002c90300a1b2c3"), None));
    let ib = &nics[0]["ports"][0];
    assert_eq!((ib["link_layer"].as_str(), ib["default_gid"].as_u64()), (Some("infiniband"), Some(0)));
    assert_eq!(nics[1]["numa_node"], 1);
    let roce = &nics[1]["ports"][0];
    assert_eq!((roce["state"].as_str(), roce["active_mtu"].as_u64()), (Some("down"), Some(1024)));
    assert_eq!(roce["gids"].as_array().unwrap().len(), 5);
    assert_eq!(roce["default_gid"], 4, "the IPv4 RoCE v2 GID, though not the first v2 one");
    let empty = &nics[1]["ports"][1];
    assert_eq!((empty["gids"].as_array().unwrap().len(), &empty["default_gid"]), (0, &Value::Null));
}

#[test]
fn no_nic_says_why() {
    let Some(shim) = shim() else { return };
    let shim = shim.to_str().unwrap();
    let none = rdma(&[("ORBITE_IBVERBS_LIB", shim), ("ORBITE_VERBS_SHIM_DEVICES", "[]")]);
    assert_eq!((none["nics"].as_array().unwrap().len(), &none["reason"]), (0, &Value::Null));
    let bad = rdma(&[("ORBITE_IBVERBS_LIB", shim), ("ORBITE_VERBS_SHIM_DEVICES", "[{\"nom\": 1}]")]);
    assert_eq!(bad["nics"].as_array().unwrap().len(), 0, "a description that does not parse is no device");
    let missing = rdma(&[("ORBITE_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")]);
    let why = missing["reason"].as_str().unwrap();
    assert!(why.contains("cannot be loaded") && why.contains("/nonexistent/libibverbs.so.1"), "{why}");
    let not_verbs = rdma(&[("ORBITE_IBVERBS_LIB", "libc.so.6")]);
    assert_eq!(not_verbs["reason"], "the verbs library libc.so.6 has no ibv_get_device_list");
}
