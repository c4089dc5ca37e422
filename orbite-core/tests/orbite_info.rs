//! `orbite info`: what a deployment engine would listen on and advertise,
//! read from ORBITE_CONFIG or `--config`, with errors that name the
//! variable.

use std::process::Command;

fn info(args: &[&str], env: Option<&str>) -> (bool, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_orbite"));
    c.arg("info").args(args).env_remove("ORBITE_CONFIG");
    if let Some(v) = env {
        c.env("ORBITE_CONFIG", v);
    }
    let out = c.output().expect("run orbite info");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
fn defaults_listen_on_all_interfaces_and_advertise_an_address() {
    let (ok, out, err) = info(&["--json"], None);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["listen"], "0.0.0.0:0");
    assert!(v["bound"].as_str().unwrap().starts_with("0.0.0.0:"), "{v}");
    let advertise = v["advertise"].as_str().unwrap();
    let ip: std::net::SocketAddr = advertise.parse().unwrap();
    assert!(!ip.ip().is_unspecified(), "{v}");
    // Only a loopback fallback may advertise loopback, and it says so.
    assert_eq!(ip.ip().is_loopback(), !v["warning"].is_null(), "{v}");
    assert!(v["config_origin"].as_str().unwrap().starts_with("defaults"), "{v}");
}

#[test]
fn orbite_config_and_explicit_config_are_read_and_errors_name_the_variable() {
    let (ok, out, err) = info(&["--json"], Some(r#"{"listen": "127.0.0.1:0", "advertise": "node-7.example"}"#));
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["config_origin"], "ORBITE_CONFIG");
    assert!(v["advertise"].as_str().unwrap().starts_with("node-7.example:"), "{v}");
    // --config wins over ORBITE_CONFIG, even an invalid one.
    let (ok, out, err) = info(&["--json", "--config", r#"{"route": "tcp"}"#], Some("{"));
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!((v["route_policy"].as_str(), v["same_host"]["cma"].as_bool()), (Some("tcp"), Some(false)));
    for bad in ["{", r#"{"advertize": 1}"#, "@/nonexistent/orbite.json", "[]"] {
        let (ok, _, err) = info(&[], Some(bad));
        assert!(!ok, "{bad}");
        assert!(err.contains("ORBITE_CONFIG"), "{bad}: {err}");
    }
}
