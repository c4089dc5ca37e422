//! `orbite info`: what an engine created for a deployment (the NIXL
//! backend's way) would listen on and advertise, and which same-host
//! routes it would offer. It starts that engine for real, reads what it
//! bound and advertises, and closes it: an operator's check of a host.

use orbite_core::config::{ConfigDocument, ConfigOrigin};
use orbite_core::endpoint::{ALL_INTERFACES, AdvertiseSource};
use orbite_core::{EngineConfig, TransferEngine};

use crate::error::{Error, config_document};

/// `orbite info`'s flags.
#[derive(Debug, clap::Args)]
#[command(args_override_self = true)]
pub(crate) struct InfoArgs {
    /// The configuration, a JSON object or @FILE (default: $ORBITE_CONFIG,
    /// a JSON object or @file; unset: the defaults)
    #[arg(long, value_name = "JSON|@FILE", value_parser = config_document)]
    config: Option<String>,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
}

/// Whether a same-host peer may use cross-memory attach on this process.
fn cma_policy() -> (bool, String) {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => (true, "no Yama policy: processes of the same user may attach".into()),
        Ok(v) => match v.trim() {
            "0" => (true, "Yama ptrace_scope 0: processes of the same user may attach".into()),
            "1" => (false, "Yama ptrace_scope 1: only ancestors may attach (CMA between peers falls back)".into()),
            s => (false, format!("Yama ptrace_scope {s}: attaching is restricted (CMA falls back)")),
        },
    }
}

/// The RDMA NICs this process sees, as JSON, and as text lines.
fn rdma() -> (serde_json::Value, Vec<String>) {
    use orbite_core::verbs::{self, GidType, LinkLayer, PortState};
    let library = verbs::library();
    let nics = match verbs::nics() {
        Ok(n) => n,
        Err(e) => {
            let json = serde_json::json!({"library": library, "nics": [], "gpus": [], "reason": e.to_string()});
            return (json, vec![format!("rdma:            no NIC ({e})")]);
        }
    };
    let kind = |k: GidType| match k {
        GidType::Ib => "ib",
        GidType::RoceV1 => "roce-v1",
        GidType::RoceV2 => "roce-v2",
    };
    let count = match nics.len() {
        1 => "1 NIC".to_owned(),
        n => format!("{n} NICs"),
    };
    let mut text = vec![format!("rdma:            {count} through {library}")];
    let mut json = Vec::new();
    for n in &nics {
        let numa = n.numa_node.map_or("unknown".to_owned(), |v| v.to_string());
        text.push(format!("  {} (guid {:#018x}, firmware {}, NUMA node {numa})", n.name, n.guid, n.firmware));
        let mut ports = Vec::new();
        for p in &n.ports {
            let state = match p.state {
                PortState::Down => "down".to_owned(),
                PortState::Init => "init".to_owned(),
                PortState::Armed => "armed".to_owned(),
                PortState::Active => "active".to_owned(),
                PortState::Other(v) => format!("state {v}"),
            };
            let link = match p.link_layer {
                LinkLayer::InfiniBand => "infiniband",
                LinkLayer::Ethernet => "ethernet",
                LinkLayer::Unspecified => "unspecified",
            };
            let default = p.default_gid().map(|g| g.index);
            text.push(format!("    port {}: {state}, {link}, MTU {}", p.port, p.active_mtu));
            for g in &p.gids {
                let mark = if Some(g.index) == default { " (default)" } else { "" };
                let dev = g.netdev.as_deref().map(|d| format!(", {d}")).unwrap_or_default();
                text.push(format!("      gid {:>3} {} {}{dev}{mark}", g.index, g.gid, kind(g.kind)));
            }
            let gids: Vec<_> = p
                .gids
                .iter()
                .map(|g| serde_json::json!({"index": g.index, "gid": g.gid.to_string(), "type": kind(g.kind), "netdev": g.netdev}))
                .collect();
            ports.push(serde_json::json!({"port": p.port, "state": state, "link_layer": link,
                "active_mtu": p.active_mtu, "default_gid": default, "gids": gids}));
        }
        json.push(serde_json::json!({"name": n.name, "guid": format!("{:#018x}", n.guid), "firmware": n.firmware,
            "numa_node": n.numa_node, "pci_path": n.pci_path, "ports": ports}));
    }
    // The NIC closest to each GPU (its PCI place from the driver).
    let mut gpus = Vec::new();
    let devices = orbite_core::cuda::availability().map_or(0, |i| i.devices);
    for ordinal in 0..devices {
        let pci = orbite_core::cuda::pci_bus_id(ordinal).ok();
        let order = verbs::closest(&nics, verbs::Near::Gpu(ordinal));
        let says = |c: &verbs::Closeness<'_>| {
            let hops = c.pci_hops.map_or("PCI place unknown".to_owned(), |h| format!("{h} PCI hops"));
            format!("{} ({hops}{})", c.nic.name, if c.same_numa { ", same NUMA node" } else { "" })
        };
        let first = order.first().map_or("none with an active port".to_owned(), says);
        text.push(format!(
            "  gpu {ordinal} ({}): closest NIC {first}",
            pci.as_deref().unwrap_or("PCI address unknown")
        ));
        let closest: Vec<_> = order
            .iter()
            .map(|c| serde_json::json!({"nic": c.nic.name, "pci_hops": c.pci_hops, "same_numa": c.same_numa}))
            .collect();
        gpus.push(serde_json::json!({"gpu": ordinal, "pci": pci, "closest": closest}));
    }
    (serde_json::json!({"library": library, "nics": json, "gpus": gpus, "reason": null}), text)
}

fn json_str(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

pub(crate) fn run(args: InfoArgs) -> Result<(), Error> {
    let doc = ConfigDocument::resolve(args.config.as_deref())?;
    let mut config = EngineConfig::from_json(&doc.json)?;
    let configured_listen = config.listen.clone();
    if config.listen.is_none() {
        config.listen = Some(ALL_INTERFACES.into());
    }
    let engine = TransferEngine::new(config.clone())?;
    let bound = engine.listen_addr().map(|a| a.to_string()).unwrap_or_default();
    let advertised = engine.advertised().cloned();
    let (endpoint, source, warning) = match &advertised {
        Some(a) => (a.endpoint.clone(), a.source.to_string(), a.warning()),
        None => (String::new(), String::new(), None),
    };
    let other_hosts = !matches!(advertised.as_ref().map(|a| &a.source), Some(AdvertiseSource::LoopbackFallback))
        && !endpoint.starts_with("127.")
        && !endpoint.starts_with("[::1]");
    let boot = orbite_core::segment::local_boot_id();
    let boot_known = boot != [0u8; 16];
    let shm = engine.allocate_shm_memory(4096).map(drop);
    // Same-host peers prove themselves over the local socket: without one,
    // no peer can be proven local.
    let local_socket = engine.segment_descriptor().local_socket;
    let (cma, cma_why) = cma_policy();
    let origin = match &doc.origin {
        ConfigOrigin::Explicit => "--config".to_owned(),
        o => o.to_string(),
    };
    let listen_text = match &configured_listen {
        Some(l) => format!("{l} (configured)"),
        None => format!("{ALL_INTERFACES} (the default: all interfaces, a free port)"),
    };
    let route = serde_json::to_value(config.route)?;
    let route = route.as_str().unwrap_or("auto").to_owned();
    let allows = |r: &str| route == "auto" || route == r;
    let local = !local_socket.is_empty();
    let shm_ok = boot_known && local && shm.is_ok() && allows("shm");
    let shm_why = match (&shm, boot_known) {
        _ if !allows("shm") => format!("route policy {route}"),
        _ if !local => "no local socket could be bound, so no peer can be proven local".to_owned(),
        (_, false) => "the boot id is unknown, so no peer can be proven local".to_owned(),
        (Ok(()), true) => "shared allocations (sealed memfds) work".to_owned(),
        (Err(e), true) => format!("cannot allocate shared memory: {e}"),
    };
    let (cma, cma_why) = match () {
        _ if !allows("cma") => (false, format!("route policy {route}")),
        _ if !local => (false, "no local socket could be bound, so no peer can be proven local".to_owned()),
        _ => (cma, cma_why),
    };
    engine.close();
    let (rdma_json, rdma_text) = rdma();
    if args.json {
        println!(
            "{{\"config_origin\":{},\"listen\":{},\"bound\":{},\"advertise\":{},\"advertise_source\":{},\
             \"other_hosts_can_connect\":{},\"warning\":{},\"route_policy\":{},\"same_host\":{{\"shm\":{},\
             \"shm_reason\":{},\"cma\":{},\"cma_reason\":{},\"local_socket\":{}}},\"tcp\":true,\"rdma\":{}}}",
            json_str(&origin),
            json_str(configured_listen.as_deref().unwrap_or(ALL_INTERFACES)),
            json_str(&bound),
            json_str(&endpoint),
            json_str(&source),
            other_hosts,
            warning.as_deref().map_or("null".into(), json_str),
            json_str(&route),
            shm_ok,
            json_str(&shm_why),
            cma && boot_known,
            json_str(&cma_why),
            json_str(&local_socket),
            rdma_json,
        );
        return Ok(());
    }
    println!("configuration:   {origin}");
    println!("listen:          {listen_text}");
    println!("bound now:       {bound} (a port 0 listener gets a new port at every start)");
    println!("advertise:       {endpoint} ({source})");
    println!(
        "other hosts:     {}",
        if other_hosts { "can dial the advertised endpoint" } else { "cannot connect: only this host can" }
    );
    if let Some(w) = warning {
        println!("warning:         {w}");
    }
    println!("route policy:    {route} (peers on other hosts: tcp)");
    println!(
        "local socket:    {} (same-host peers in this network namespace prove themselves over it)",
        if local { local_socket.as_str() } else { "none" }
    );
    println!("same-host shm:   {} ({shm_why})", if shm_ok { "offered" } else { "not offered" });
    println!("same-host cma:   {} ({cma_why})", if cma && boot_known { "offered" } else { "not offered" });
    for line in rdma_text {
        println!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::InfoArgs;
    use crate::{Command, parse};

    fn info(args: &[&str]) -> (Option<String>, bool) {
        match parse(&[&["info"], args].concat()) {
            Ok(Command::Info(InfoArgs { config, json })) => (config, json),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn config_is_a_document_or_a_file() {
        assert_eq!(info(&[]), (None, false));
        assert_eq!(info(&["--json", "--config", r#"{"route": "tcp"}"#]), (Some(r#"{"route": "tcp"}"#.into()), true));
        let path = std::env::temp_dir().join(format!("orbite-info-args-{}.json", std::process::id()));
        std::fs::write(&path, r#"{"listen": "127.0.0.1:0"}"#).unwrap();
        let at = format!("@{}", path.display());
        assert_eq!(info(&["--config", &at]).0.as_deref(), Some(r#"{"listen": "127.0.0.1:0"}"#));
        std::fs::remove_file(&path).unwrap();
        let e = parse(&["info", "--config", &at]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(e.to_string().contains("--config") && e.to_string().contains("cannot read"), "{e}");
        // Checked when the engine is made, as before: the text is kept.
        assert_eq!(info(&["--config", "{"]).0.as_deref(), Some("{"));
    }
}
