//! The `orbite` command line as a user meets it: help from clap, refused
//! flags and values named on stderr with a non-zero exit, runtime errors as
//! `orbite: <error>` with exit 1, and the commands still working.

use std::process::Command;

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn orbite(args: &[&str]) -> Run {
    let out =
        Command::new(env!("CARGO_BIN_EXE_orbite")).args(args).env_remove("ORBITE_CONFIG").output().expect("run orbite");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn help_lists_the_commands_and_each_commands_flags() {
    let top = orbite(&["--help"]);
    assert_eq!(top.code, Some(0), "{}", top.stderr);
    assert!(top.stdout.contains("Usage: orbite"), "{}", top.stdout);
    for c in ["bench", "copy", "info", "serve", "help"] {
        assert!(top.stdout.lines().any(|l| l.trim_start().starts_with(&format!("{c} "))), "{c}: {}", top.stdout);
    }
    // The bench harness's own processes are not for users.
    assert!(!top.stdout.contains("bench-target") && !top.stdout.contains("bench-fanin"), "{}", top.stdout);
    assert_eq!(orbite(&["help"]).stdout, top.stdout);

    let grpc = cfg!(feature = "grpc");
    for (command, flags) in [
        ("bench", &["--route", "--workload", "--quick", "--blocks", "--ops", "--config", "--json", "--plot"][..]),
        ("copy", &["--bytes", "--block"]),
        ("info", &["--config", "--json"]),
        ("serve", if grpc { &["--listen", "--config"] } else { &[] }),
    ] {
        let help = orbite(&[command, "--help"]);
        assert_eq!(help.code, Some(0), "{command}: {}", help.stderr);
        assert!(help.stdout.contains(&format!("Usage: orbite {command}")), "{}", help.stdout);
        for flag in flags {
            assert!(help.stdout.contains(flag), "{command} {flag}: {}", help.stdout);
        }
        assert_eq!(orbite(&["help", command]).stdout, help.stdout);
    }
}

#[test]
fn unknown_flags_and_bad_values_are_named_with_a_non_zero_exit() {
    for args in [&["bench", "--nope"][..], &["copy", "--nope", "1"], &["info", "--nope"]] {
        let r = orbite(args);
        assert!(!matches!(r.code, Some(0) | None), "{args:?}: {:?}", r.code);
        assert!(r.stderr.contains("--nope"), "{args:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?}: {}", r.stdout);
    }
    let r = orbite(&["nope"]);
    assert!(r.code != Some(0) && r.stderr.contains("nope"), "{}", r.stderr);
    for (args, flag, why) in [
        (&["bench", "--route", "tcp,udp"][..], "--route", "unknown route `udp`"),
        (&["bench", "--blocks", "1000"], "--blocks", "does not divide 64 MiB"),
        (&["bench", "--config", "[]"], "--config", "needs a JSON object"),
        (&["copy", "--bytes", "lots"], "--bytes", "invalid digit"),
    ] {
        let r = orbite(args);
        assert!(r.code != Some(0), "{args:?}");
        assert!(r.stderr.contains(flag) && r.stderr.contains(why), "{args:?}: {}", r.stderr);
    }
}

#[test]
fn runtime_errors_print_orbite_and_exit_1() {
    let r = orbite(&["copy", "--bytes", "3", "--block", "2"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.trim(), "orbite: --bytes must be a nonzero multiple of --block");
    let r = orbite(&["info", "--config", r#"{"listen": 7}"#]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.starts_with("orbite: invalid engine configuration"), "{}", r.stderr);
    let r = orbite(&["bench-fanin", "127.0.0.1:1", "1", "60", "10", "0.1", ""]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.starts_with("orbite: slices 60..+10 are outside"), "{}", r.stderr);
}

#[cfg(not(feature = "grpc"))]
#[test]
fn serve_without_grpc_says_how_to_build_it() {
    let r = orbite(&["serve", "--listen", "127.0.0.1:0"]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.starts_with("orbite: this orbite was built without the KV session service"), "{}", r.stderr);
    assert!(r.stderr.contains("--features grpc"), "{}", r.stderr);
}

#[cfg(feature = "grpc")]
#[test]
fn serve_needs_listen() {
    let r = orbite(&["serve"]);
    assert!(r.code != Some(0) && r.stderr.contains("--listen"), "{}", r.stderr);
}

#[test]
fn info_and_copy_still_work() {
    let r = orbite(&["info", "--json", "--config", r#"{"listen": "127.0.0.1:0", "route": "tcp"}"#]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", r.stdout));
    assert_eq!((v["listen"].as_str(), v["route_policy"].as_str()), (Some("127.0.0.1:0"), Some("tcp")));
    let r = orbite(&["info"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("configuration:") && r.stdout.contains("listen:"), "{}", r.stdout);
    let r = orbite(&["copy", "--bytes", "1048576", "--block", "65536"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.starts_with("moved 1048576 bytes in 16 descriptors of 65536 bytes"), "{}", r.stdout);
    assert!(r.stdout.trim_end().ends_with("bytes verified: true"), "{}", r.stdout);
}

/// Every element opens and closes in order, attributes quoted: the
/// well-formedness an SVG reader needs of our writer's output.
fn well_formed(xml: &str) -> Result<usize, String> {
    let mut open: Vec<&str> = Vec::new();
    let mut elements = 0;
    let mut rest = xml;
    while let Some(at) = rest.find('<') {
        let tail = &rest[at + 1..];
        let end = tail.find('>').ok_or("an unclosed tag")?;
        let tag = &tail[..end];
        if tag.matches('"').count() % 2 != 0 {
            return Err(format!("unbalanced quotes in <{tag}>"));
        }
        if let Some(name) = tag.strip_prefix('/') {
            if open.pop() != Some(name.trim()) {
                return Err(format!("</{name}> closes nothing open"));
            }
        } else if !tag.ends_with('/') {
            open.push(tag.split_whitespace().next().ok_or("an empty tag")?);
        }
        elements += 1;
        rest = &tail[end + 1..];
    }
    if open.is_empty() { Ok(elements) } else { Err(format!("{open:?} never closed")) }
}

/// `--plot` writes W1's figures as an SVG, silently when stderr is not a
/// terminal (no progress lines then).
#[test]
fn bench_plot_writes_an_svg() {
    let path = std::env::temp_dir().join(format!("orbite-plot-{}.svg", std::process::id()));
    let r = orbite(&[
        "bench",
        "--route",
        "local",
        "--workload",
        "W1",
        "--quick",
        "--blocks",
        "4096,65536",
        "--json",
        "--plot",
        path.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stderr.contains("orbite bench:"), "no progress lines without a terminal: {}", r.stderr);
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""), "{svg}");
    let elements = well_formed(&svg).unwrap_or_else(|e| panic!("{e}: {svg}"));
    assert!(elements > 20, "axes, lines and legend");
    assert!(svg.contains("local W1-write") && svg.contains("stroke-dasharray"), "lines and their limits");
    let _ = std::fs::remove_file(&path);
    let r = orbite(&["bench", "--route", "local", "--workload", "idle", "--quick", "--plot", path.to_str().unwrap()]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("no W1 row"), "{}", r.stderr);
}
