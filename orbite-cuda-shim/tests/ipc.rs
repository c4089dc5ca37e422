//! IPC memory handles between processes: this test binary spawns itself as
//! the other process, the handle passed in hex (an environment variable one
//! way, the child's stdout the other).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use common::*;
use sys::CUpointer_attribute as PA;

const N: usize = 3 * 4096 + 100;

fn export(d: sys::CUdeviceptr) -> sys::CUipcMemHandle {
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuIpcGetMemHandle(&mut h, d) });
    h
}

fn handle_hex(h: &sys::CUipcMemHandle) -> String {
    to_hex(&h.reserved.map(|c| c as u8))
}

fn handle_from_hex(s: &str) -> sys::CUipcMemHandle {
    let b = from_hex(s.trim());
    assert_eq!(b.len(), 64);
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (dst, src) in h.reserved.iter_mut().zip(b) {
        *dst = src as _;
    }
    h
}

fn import(h: sys::CUipcMemHandle) -> Result<sys::CUdeviceptr, CUresult> {
    let mut p = 0;
    // SAFETY: out-pointer to a local; the handle is passed by value.
    let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, 1) };
    if r == CUresult::CUDA_SUCCESS { Ok(p) } else { Err(r) }
}

fn close(p: sys::CUdeviceptr) {
    // SAFETY: no pointer arguments.
    ok(unsafe { sys::cuIpcCloseMemHandle(p) });
}

fn memory_type(p: sys::CUdeviceptr) -> u32 {
    let mut v = 0u32;
    // SAFETY: `v` is the attribute's type.
    ok(unsafe { sys::cuPointerGetAttribute((&raw mut v).cast(), PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) });
    v
}

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    match role.as_str() {
        // Imports the parent's handle, checks the parent's bytes, writes
        // its own.
        "importer" => {
            let ctx = use_device(1);
            let h = handle_from_hex(&std::env::var("HANDLE").expect("HANDLE"));
            let p = import(h).expect("import");
            assert_eq!(memory_type(p), 2);
            let mut owner = std::ptr::null_mut::<std::ffi::c_void>();
            // SAFETY: `owner` is the attribute's type (CUcontext).
            ok(unsafe { sys::cuPointerGetAttribute((&raw mut owner).cast(), PA::CU_POINTER_ATTRIBUTE_CONTEXT, p) });
            assert_eq!(owner, ctx.cast(), "an import belongs to the importer's context");
            let (mut base, mut size) = (0, 0);
            // SAFETY: out-pointers to locals.
            ok(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p + 5) });
            assert_eq!((base, size), (p, N));
            same_bytes(&dtoh(p, N), &pattern(N, 1), "the exporter's bytes");
            htod(p, &pattern(N, 2));
            close(p);
            assert_eq!(import(h).map(close), Ok(()), "a handle opens again");
        }
        // Exports a buffer, prints its handle, waits for the parent to say
        // it wrote, checks the parent's bytes, frees and exits.
        "exporter" => {
            use_device(0);
            let d = alloc(N);
            htod(d, &pattern(N, 3));
            println!("HANDLE {}", handle_hex(&export(d)));
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "WROTE");
            same_bytes(&dtoh(d, N), &pattern(N, 4), "the importer's bytes");
            // A freed allocation's handle no longer opens.
            let h = export(d);
            free(d);
            println!("FREED {}", handle_hex(&h));
            std::io::stdout().flush().unwrap();
            line.clear();
            std::io::stdin().read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "EXIT");
        }
        // In another pid namespace (its own /proc): the exporter's pid
        // means nothing there.
        "importer-elsewhere" => {
            use_device(0);
            let h = handle_from_hex(&std::env::var("HANDLE").expect("HANDLE"));
            assert_eq!(import(h), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
        }
        other => panic!("unknown role {other}"),
    }
    println!("CHILD-OK");
}

#[test]
fn parent_exports_child_imports() {
    need_shim!();
    use_device(0);
    let d = alloc(N);
    htod(d, &pattern(N, 1));
    let h = export(d);
    // Any address in the allocation names the whole of it.
    assert_eq!(handle_hex(&export(d + 77)), handle_hex(&h));
    assert_eq!(import(h), Err(CUresult::CUDA_ERROR_INVALID_CONTEXT), "not in the exporting process");
    let out = run_child("child_entry", "importer", &[("HANDLE", &handle_hex(&h))]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
    same_bytes(&dtoh(d, N), &pattern(N, 2), "the importer's bytes");
    free(d);
}

#[test]
fn child_exports_parent_imports() {
    need_shim!();
    use_device(1);
    let mut child =
        child("child_entry", "exporter", &[]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let line = lines.next().expect("child output ended").expect("read");
        // The harness may print "test child_entry ... " ahead on the line.
        if let Some(at) = line.find(prefix) {
            break line[at + prefix.len()..].trim().to_owned();
        }
    };
    let h = handle_from_hex(&next("HANDLE "));
    let p = import(h).expect("import");
    assert_eq!(memory_type(p), 2);
    same_bytes(&dtoh(p, N), &pattern(N, 3), "the exporter's bytes");
    htod(p, &pattern(N, 4));
    close(p);
    writeln!(stdin, "WROTE").unwrap();

    let freed = handle_from_hex(&next("FREED "));
    assert_eq!(import(freed), Err(CUresult::CUDA_ERROR_INVALID_VALUE), "the exporter freed it");
    writeln!(stdin, "EXIT").unwrap();
    assert_eq!(next("CHILD-OK"), "");
    let status = child.wait().unwrap();
    assert!(status.success(), "exporter: {status}");
    assert_eq!(import(h), Err(CUresult::CUDA_ERROR_INVALID_VALUE), "the exporter is gone");

    // Malformed handles.
    let mut bad = h;
    bad.reserved[0] ^= 1;
    assert_eq!(import(bad), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(import(sys::CUipcMemHandle { reserved: [0; 64] }), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    // SAFETY: no pointer arguments.
    assert_eq!(unsafe { sys::cuIpcCloseMemHandle(0x1000) }, CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn another_pid_namespace_cannot_import() {
    need_shim!();
    let probe = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        println!("SKIP: unshare --pid --mount-proc is not permitted here");
        return;
    }
    use_device(0);
    let d = alloc(N);
    let h = export(d);
    let cmd = child("child_entry", "importer-elsewhere", &[("HANDLE", &handle_hex(&h))]);
    let mut wrapped = std::process::Command::new("unshare");
    wrapped.args(["--pid", "--fork", "--mount-proc"]).arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => wrapped.env(k, v),
            None => wrapped.env_remove(k),
        };
    }
    let out = wrapped.output().expect("spawn");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("CHILD-OK"), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    free(d);
}
