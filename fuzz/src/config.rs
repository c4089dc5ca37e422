//! The configuration JSON: `EngineConfig::from_json` (parse and validate,
//! what `TransferEngine::from_json` and `orbite_engine_create` run before
//! anything starts; no engine is started here), and the NIXL plugin's own
//! scanner of the same document (`addDefault`, which inserts a default
//! before the engine sees the JSON).
//!
//! Input: a JSON document. Checks: an accepted configuration is a JSON
//! object, serialises and parses back to itself, and its derived values
//! are computable; the plugin accepts every JSON object, and what it makes
//! of a valid configuration is still one, with its default added.

use orbite_core::EngineConfig;
use serde_json::Value;

use crate::plugin::{self, Outcome};

pub fn run(data: &[u8]) {
    let json = std::str::from_utf8(data).ok();
    let config = json.and_then(|j| EngineConfig::from_json(j).ok());
    if let Some(c) = &config {
        let value: Value = serde_json::from_str(json.expect("parsed")).expect("an accepted configuration is JSON");
        assert!(value.is_object(), "EngineConfig::from_json accepts only a JSON object");
        let text = serde_json::to_string(c).expect("a configuration serialises");
        let again = EngineConfig::from_json(&text).expect("a serialised configuration is accepted");
        assert_eq!(&again, c, "configuration round trip");
        let _ = (c.progress_interval(), c.route_workers(), c.spin(), c.peer_timeout(), c.close_drain_timeout());
        // The deadline of the largest request the configuration allows
        // (saturating, never a panic).
        let _ = c.request_deadline(c.max_transfer_bytes);
    }
    plugin_default(data, json, config.as_ref());
}

/// The plugin's addDefault of `"progress_worker": true`, as its
/// buildConfig adds it for enableProgTh.
fn plugin_default(data: &[u8], json: Option<&str>, config: Option<&EngineConfig>) {
    let Some(outcome) = plugin::add_default(data, "progress_worker", "true") else { return };
    let doc = match outcome {
        Outcome::Threw => panic!("the plugin's addDefault threw"),
        Outcome::Returned(doc) => doc,
    };
    let object = json.and_then(|j| serde_json::from_str::<Value>(j).ok()).filter(Value::is_object);
    let Some(object) = object else { return };
    let Some(doc) = doc else { panic!("the plugin refuses a JSON object") };
    let doc = String::from_utf8(doc).expect("the plugin keeps UTF-8 UTF-8");
    let edited: Value = match serde_json::from_str(&doc) {
        Ok(v) => v,
        Err(e) => panic!("the plugin turned a JSON object into invalid JSON ({e}): {doc:?}"),
    };
    assert!(edited.is_object(), "the plugin keeps an object an object");
    // Escaped keys are compared by the scanner as written, by serde as
    // meant: leave them out of the exact comparison.
    if data.contains(&b'\\') {
        return;
    }
    let had = object.as_object().is_some_and(|o| o.contains_key("progress_worker"));
    let mut expected = object.clone();
    if !had {
        expected.as_object_mut().expect("an object").insert("progress_worker".into(), Value::Bool(true));
    }
    assert_eq!(edited, expected, "the plugin adds its default and changes nothing else");
    if let Some(c) = config {
        let c2 = EngineConfig::from_json(&doc).expect("the plugin keeps a valid configuration valid");
        let mut expected = c.clone();
        if !had {
            expected.progress_worker = true;
        }
        assert_eq!(c2, expected);
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    let default = serde_json::to_string_pretty(&EngineConfig::default()).expect("defaults serialise");
    [
        "{}",
        " { \"max_bytes_in_flight\": 268435456, \"task_bytes\": 65536 } ",
        r#"{"listen": "127.0.0.1:0", "advertise": "host.example:5000", "auth": {"secret_file": "/tmp/s"}}"#,
        r#"{"route": "tcp", "progress_worker": false, "spin_us": 1000, "connections_per_peer": 16}"#,
        r#"{"max_transfer_bytes": 18446744073709551615, "peer_min_bytes_per_s": 1}"#,
        r#"{"max_executons": 5}"#,
        r#"{"listen": "a\"b{\\", "x": [1, {"y": "}"}]}"#,
        "[1, 2]",
        &default,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}
