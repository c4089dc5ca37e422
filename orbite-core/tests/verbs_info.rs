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

/// With the CUDA driver (feature `cuda`, the driver shim: GPU `n` at PCI
/// `0000:0{n+1}:00.0`) and a fake sysfs tree, `orbite info` names the NIC
/// closest to each GPU: fewest PCI hops, then the same NUMA node; a NIC
/// with no active port is never named. Without a driver the list is
/// empty (SKIP here unless `ORBITE_CUDA_REQUIRED`).
#[test]
fn the_nic_closest_to_each_gpu_is_the_fewest_pci_hops_away() {
    let Some(shim) = shim() else { return };
    let sysfs = std::env::temp_dir().join(format!("orbite-verbs-topology-{}", std::process::id()));
    let dev = |p: &str, numa: u32| {
        let d = sysfs.join("devices").join(p);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
        d
    };
    let link = |target: &std::path::Path, at: std::path::PathBuf| {
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, at).unwrap();
    };
    // GPU 0 and mlx5_0 behind one bridge; GPU 1 and mlx5_1 under another
    // root complex (NUMA node 1); mlx5_2 across GPU 0's root complex, its
    // port down.
    for (bdf, path, numa) in [
        ("0000:01:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0", 0),
        ("0000:02:00.0", "pci0000:80/0000:80:01.0/0000:02:00.0", 1),
    ] {
        link(&dev(path, numa), sysfs.join("bus/pci/devices").join(bdf));
    }
    for (nic, path, numa) in [
        ("mlx5_0", "pci0000:00/0000:00:01.0/0000:10:00.0", 0),
        ("mlx5_1", "pci0000:80/0000:80:01.0/0000:90:00.0", 1),
        ("mlx5_2", "pci0000:00/0000:00:02.0/0000:11:00.0", 0),
    ] {
        link(&dev(path, numa), sysfs.join("class/infiniband").join(nic).join("device"));
    }
    let port =
        |state: &str| format!(r#"{{"state": "{state}", "gids": [{{"gid": "::ffff:127.0.0.1", "type": "roce-v2"}}]}}"#);
    let devices = format!(
        r#"[{{"name": "mlx5_2", "ports": [{}]}}, {{"name": "mlx5_1", "ports": [{}]}}, {{"name": "mlx5_0", "ports": [{}]}}]"#,
        port("down"),
        port("active"),
        port("active")
    );
    let r = rdma(&[
        ("ORBITE_IBVERBS_LIB", shim.to_str().unwrap()),
        ("ORBITE_VERBS_SHIM_DEVICES", &devices),
        ("ORBITE_SYSFS_ROOT", sysfs.to_str().unwrap()),
    ]);
    std::fs::remove_dir_all(&sysfs).unwrap();
    let gpus = r["gpus"].as_array().unwrap();
    if gpus.is_empty() {
        assert!(std::env::var_os("ORBITE_CUDA_REQUIRED").is_none(), "ORBITE_CUDA_REQUIRED: no GPU listed: {r}");
        println!("SKIP: no CUDA driver for this orbite (feature cuda and the driver shim on the library path)");
        return;
    }
    assert!(r["nics"][2]["pci_path"].as_str().unwrap().ends_with("0000:00:01.0/0000:10:00.0"), "{r}");
    let names = |g: &Value| {
        g["closest"].as_array().unwrap().iter().map(|c| c["nic"].as_str().unwrap().to_owned()).collect::<Vec<_>>()
    };
    assert_eq!(
        (gpus[0]["pci"].as_str(), names(&gpus[0])),
        (Some("0000:01:00.0"), vec!["mlx5_0".to_owned(), "mlx5_1".into()])
    );
    assert_eq!(gpus[0]["closest"][0]["pci_hops"], 2);
    assert_eq!(gpus[0]["closest"][0]["same_numa"], true);
    assert_eq!(names(&gpus[1]), ["mlx5_1", "mlx5_0"], "GPU 1's own root complex first");
    assert_eq!(gpus[1]["closest"][0]["pci_hops"], 2);
}
