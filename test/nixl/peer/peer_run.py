#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The runner of scripts/nixl-peer-tests (see its head for what runs and what
counts); the environment (plugin folder, venv, etcd binary) comes from there.

    peer_run.py --nixl-src DIR --work DIR [--etcd BIN | --no-etcd WHY] [CASE...]

CASE: names (or prefixes) of the cases to run; default all. Each case runs
twice, each time in a fresh copy of the NIXL files it needs under --work:
ours (backend names swapped by SWAP below, and NIXL's default backend list
swapped in the process, test/nixl/peer/peer_env.py), then the reference (the
files as they are). CPU_PATCHES are applied to both copies alike.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable

# Our substitution table: NIXL's backend name -> ours. Only quoted string
# literals that are exactly the name are swapped ("UCX", 'POSIX'), so
# backends=["UCX"], default="UCX" and createBackend("UCX", ...) change and
# prose such as "UCX not available" or the typo test's "UVX" do not.
SWAP = {"UCX": "ORBITE", "POSIX": "ORBITE_FILE"}

# Applied to the reference and to ours alike, before the swap, each exactly
# as often as written here (a NIXL tree where they do not match is an error):
# the remote-storage example on a host without CUDA and without GDS_MT.
CPU_PATCHES = {
    "examples/python/remote_storage_example/nixl_p2p_storage_example.py": [
        # The client's memory: DRAM, as the server's (VRAM needs CUDA torch).
        ('mem = "VRAM"', 'mem = "DRAM"', 1),
        # The client's local storage transfers are pinned to GDS_MT, which
        # is absent (self.backends["GDS_MT"] would raise KeyError): they go
        # to POSIX, the storage backend the example created instead.
        ('["GDS_MT"]', '["POSIX"]', 2),
    ],
}


def swap_names(text):
    for theirs, ours in SWAP.items():
        text = re.sub(r"""(["'])%s\1""" % re.escape(theirs), r"\g<1>%s\g<1>" % ours, text)
    return text


def copy_files(src_root, rels, dst, ours):
    """Copies src_root/REL (files, or folders of .py files) to dst/basename."""
    for rel in rels:
        src = os.path.join(src_root, rel)
        if os.path.isdir(src):
            for dirpath, _, names in os.walk(src):
                for name in names:
                    full = os.path.join(dirpath, name)
                    sub = os.path.relpath(full, os.path.dirname(src))
                    copy_one(src_root, os.path.relpath(full, src_root), os.path.join(dst, sub), ours)
        else:
            copy_one(src_root, rel, os.path.join(dst, os.path.basename(rel)), ours)


def copy_one(src_root, rel, out, ours):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if not rel.endswith((".py", ".in")):
        return  # pictures, READMEs: not needed
    with open(os.path.join(src_root, rel)) as f:
        text = f.read()
    for old, new, count in CPU_PATCHES.get(rel, []):
        found = text.count(old)
        if found != count:
            raise RuntimeError(f"{rel}: expected {count} x {old!r}, found {found} (not NIXL v1.4.0?)")
        text = text.replace(old, new)
    with open(out, "w") as f:
        f.write(swap_names(text) if ours else text)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """The processes of one run: each in its own process group, output to a
    log file; all ended (group, SIGTERM then SIGKILL) by end()."""

    started_pids = []

    def __init__(self, folder, env):
        self.folder, self.env, self.procs = folder, env, []

    def start(self, name, cmd, stdin=None, extra_env=None):
        env = dict(self.env, **(extra_env or {}))
        with open(os.path.join(self.folder, f"{name}.log"), "w") as log:
            p = subprocess.Popen(cmd, cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                 start_new_session=True)
        p.name, p.log = name, log.name
        self.procs.append(p)
        Procs.started_pids.append(p.pid)
        return p

    @staticmethod
    def text(p):
        with open(p.log, errors="replace") as f:
            return f.read()

    def wait_for_line(self, p, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text(p)):
                return True
            if p.poll() is not None:
                return bool(re.search(pattern, self.text(p)))
            time.sleep(0.1)
        return False

    @staticmethod
    def wait(p, timeout):
        """The exit status, or None after timeout seconds."""
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def end(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            if self.wait(p, 5) is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            if p.stdin:
                p.stdin.close()

    def tails(self, lines=15):
        """The last lines of each process's output, runs of one message
        (NIXL's retry loops log one per try) folded into one line."""
        out = []
        for p in self.procs:
            folded = []
            for line in self.text(p).rstrip().splitlines():
                key = re.sub(r"^([EWIF]\d{4} [\d:.]+ +\d+ |[\d-]+ [\d:]+ )", "", line)
                if folded and folded[-1][0] == key:
                    folded[-1][2] += 1
                else:
                    folded.append([key, line, 1])
            shown = [f"{line}  [{n} times]" if n > 1 else line for _, line, n in folded[-lines:]]
            out.append(f"--- {p.name} (exit {p.returncode}), its last {len(shown)} of {len(folded)} lines:")
            out.extend(shown)
        return "\n".join(out)


def sweep_shm():
    """/dev/shm/orbite-<pid>-* left by the processes we started and killed."""
    for name in os.listdir("/dev/shm"):
        m = re.match(r"orbite-(\d+)-", name)
        if m and int(m.group(1)) in Procs.started_pids:
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                try:
                    os.remove(os.path.join("/dev/shm", name))
                except OSError:
                    pass


class Etcd:
    def __init__(self, binary, folder):
        self.binary, self.folder, self.proc, self.url = binary, folder, None, None

    def start(self):
        client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        with open(os.path.join(self.folder, "etcd.log"), "w") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--name", "peer-tests", "--data-dir", os.path.join(self.folder, "etcd-data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"peer-tests={peer_url}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
                with direct.open(self.url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return None
            except OSError:
                pass
            time.sleep(0.2)
        with open(log.name, errors="replace") as f:
            tail = f.read()[-600:]
        self.stop()
        return f"etcd did not become healthy on {self.url}: {tail}"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


class Run:
    """One run of one case: a fresh folder, ours or the reference."""

    def __init__(self, suite, ours, folder):
        self.suite, self.ours, self.dir = suite, ours, folder
        env = dict(os.environ)
        # Loopback only: no proxy (NIXL's etcd client is gRPC, which honours them).
        env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
        env["PYTHONPATH"] = HERE + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["ORBITE_PEER_OURS"] = "1" if ours else "0"
        env["ORBITE_PEER_TORCH_STANDIN"] = "0" if suite.torch else "1"
        self.procs = Procs(folder, env)

    def copy(self, *rels):
        copy_files(self.suite.src, rels, self.dir, self.ours)

    def launch(self, name, script, args, **kw):
        return self.procs.start(name, [PY, os.path.join(HERE, "peer_env.py"), script] + args, **kw)

    def net(self):
        """What ours replaces UCX with, or UCX."""
        return "ORBITE" if self.ours else "UCX"


def fail(why, run):
    return False, why + "\n" + run.procs.tails()


def check_markers(run, p, must, must_not=("Error state", "verification failed", "Traceback")):
    text = run.procs.text(p)
    missing = [m for m in must if m not in text]
    found = [m for m in must_not if m in text]
    if missing or found:
        return (f"{p.name}: " + (f"missing {missing}" if missing else "")
                + ("; " if missing and found else "") + (f"printed {found}" if found else ""))
    return None


# --- the cases -------------------------------------------------------------------

def case_pytest(rel):
    def run_it(run):
        run.copy(rel, "test/python/conftest.py")
        p = run.procs.start("pytest", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_env",
                                       "-rfEs", os.path.basename(rel)])
        rc = run.procs.wait(p, 240)
        text = run.procs.text(p)
        counts = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
        summary = ", ".join(c for c in counts[-1].split(", ") if "warning" not in c) if counts else "no summary"
        if rc is None:
            return fail("timed out after 240 s", run)
        if rc != 0:
            return fail(f"pytest exit {rc} ({summary})", run)
        return True, summary
    return run_it


def two_peers(script, ready, initiator_must, target_must):
    def run_it(run):
        run.copy(f"examples/python/{script}")
        port = free_port()
        args = ["--ip", "127.0.0.1", "--port", str(port)]
        target = run.launch("target", script, args + ["--mode", "target"])
        if not run.procs.wait_for_line(target, re.escape(ready), 60):
            return fail(f"the target did not get to {ready!r}", run)
        init = run.launch("initiator", script, args + ["--mode", "initiator"])
        rc_i, rc_t = run.procs.wait(init, 90), run.procs.wait(target, 30)
        if rc_i is None or rc_t is None:
            return fail("timed out", run)
        if rc_i or rc_t:
            return fail(f"exit status: initiator {rc_i}, target {rc_t}", run)
        why = check_markers(run, init, initiator_must) or check_markers(run, target, target_must)
        return fail(why, run) if why else (True, "")
    return run_it


PARTIAL_MD_MUST = ["Correct exception", "Test Complete."]


def partial_md_checks(run, p):
    rc = run.procs.wait(p, 90)
    if rc is None:
        return fail("timed out after 90 s", run)
    if rc:
        return fail(f"exit status {rc}", run)
    why = check_markers(run, p, PARTIAL_MD_MUST, ("Incorrect success", "Error state", "Traceback"))
    text = run.procs.text(p)
    if not why and (text.count("Initiator done") != 2 or text.count("Target done") != 2):
        why = "not both transfers were seen done by both agents"
    return fail(why, run) if why else (True, "")


def case_partial_md_listener(run):
    run.copy("examples/python/partial_md_example.py")
    # Without --etcd the example deletes NIXL_ETCD_ENDPOINTS, which raises
    # KeyError when it is not set (NIXL's bug): set it, to be deleted.
    p = run.launch("partial_md", "partial_md_example.py",
                   ["--init-port", str(free_port()), "--target-port", str(free_port())],
                   extra_env={"NIXL_ETCD_ENDPOINTS": "http://127.0.0.1:9"})
    return partial_md_checks(run, p)


def case_partial_md_etcd(run):
    url = run.suite.etcd_url()
    run.copy("examples/python/partial_md_example.py")
    namespace = f"/orbite-peer-tests/{os.getpid()}/{'ours' if run.ours else 'reference'}/"
    p = run.launch("partial_md", "partial_md_example.py", ["--etcd"],
                   extra_env={"NIXL_ETCD_ENDPOINTS": url, "NIXL_ETCD_NAMESPACE": namespace})
    return partial_md_checks(run, p)


def case_query_mem(run):
    run.copy("examples/python/query_mem_example.py")
    p = run.launch("query_mem", "query_mem_example.py", [])
    rc = run.procs.wait(p, 60)
    if rc is None:
        return fail("timed out after 60 s", run)
    if rc:
        return fail(f"exit status {rc}", run)
    # "Created backend: POSIX" is prose, printed in ours too (after the
    # backend of the swapped create_backend("ORBITE_FILE") was made).
    why = check_markers(run, p, ["Created backend: POSIX", "Example completed successfully!"],
                        ("MOCK_DRAM", "Traceback"))
    if why:
        return fail(why, run)
    # Descriptors 0, 1 and 3 are files of 23 bytes ("Test content for file
    # 0"), 2 does not exist; modes are of regular files, times recent.
    text = run.procs.text(p)
    got = re.findall(r"(File size: (\S+) bytes|File mode: (\S+)|Modified time: (\S+)|does not exist)", text)
    seen, now = [], time.time()
    for whole, size, mode, mtime in got:
        if whole == "does not exist":
            seen.append("missing")
        elif size:
            seen.append(f"size {size}")
        elif mode:
            ok = mode.isdigit() and stat.S_ISREG(int(mode))
            seen[-1] += "" if ok else f" mode {mode}?"
        elif mtime:
            ok = mtime.isdigit() and abs(int(mtime) - now) < 86400
            seen[-1] += "" if ok else f" mtime {mtime}?"
    want = ["size 23", "size 23", "missing", "size 23"]
    if seen != want:
        return fail(f"query results {seen}, want {want}", run)
    return True, ""


def case_remote_storage(run):
    run.copy("examples/python/remote_storage_example")
    script = "remote_storage_example/nixl_p2p_storage_example.py"
    files = os.path.join(run.dir, "files")
    os.mkdir(files)
    batch, size, iterations = 4, 4096, 8
    common = ["--buf_size", str(size), "--batch_size", str(batch)]
    server_port = free_port()
    agents = os.path.join(run.dir, "agents.txt")
    with open(agents, "w") as f:
        f.write(f"target1 127.0.0.1 {server_port}\n")
    server = run.launch("server", script, ["--role", "server", "--name", "target1", "--port", str(server_port),
                                           "--fileprefix", os.path.join(files, "server")] + common)
    if not run.procs.wait_for_line(server, "Server initialized", 60):
        return fail("the server did not get to 'Server initialized'", run)
    client = run.launch("client", script, ["--role", "client", "--name", "client1", "--port", str(free_port()),
                                           "--agents_file", agents, "--fileprefix", os.path.join(files, "client"),
                                           "--iterations", str(iterations)] + common)
    rc = run.procs.wait(client, 120)
    if rc is None:
        return fail("the client timed out after 120 s", run)
    time.sleep(0.3)
    if server.poll() is not None:
        return fail(f"the server exited ({server.returncode}) while it should serve on", run)
    if rc:
        return fail(f"client exit status {rc}", run)
    why = (check_markers(run, client, ["Local transfer test complete", "Remote transfer test complete",
                                       "Test Complete."])
           or check_markers(run, server, [f"Performing WRITE with {iterations} iterations",
                                          f"Performing READ with {iterations} iterations"]))
    if why:
        return fail(why, run)
    sizes = {n: os.path.getsize(os.path.join(files, n)) for n in sorted(os.listdir(files))}
    want = {f"{who}_{i}": size for who in ("client", "server") for i in range(batch)}
    if sizes != want:
        return fail(f"the storage files are {sizes}, want {want}", run)
    return True, ""


def case_telemetry(run):
    run.copy("examples/python/telemetry_reader.py")
    tdir = os.path.join(run.dir, "telemetry")
    os.mkdir(tdir)
    env = {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_DIR": tdir}
    producer = run.procs.start("producer", [PY, os.path.join(HERE, "peer_telemetry_producer.py"), run.net()],
                               stdin=subprocess.PIPE, extra_env=env)
    if not run.procs.wait_for_line(producer, r"telemetry file: ", 60):
        return fail("the producer did not make its agents", run)
    path = re.search(r"telemetry file: (.*)", run.procs.text(producer)).group(1).strip()
    reader = run.procs.start("reader", [PY, "telemetry_reader.py", "--telemetry_path", path])
    if not run.procs.wait_for_line(reader, "Successfully opened telemetry buffer", 30):
        return fail("the reader did not open the telemetry buffer", run)
    producer.stdin.write(b"go\n")
    producer.stdin.flush()
    rc = run.procs.wait(producer, 60)
    if rc is None or rc:
        return fail(f"the producer {'timed out' if rc is None else f'exited {rc}'}", run)
    time.sleep(1.5)  # the reader polls every 0.5 s
    reader.send_signal(signal.SIGINT)
    rc = run.procs.wait(reader, 15)
    if rc is None or rc:
        return fail(f"the reader {'did not stop on SIGINT' if rc is None else f'exited {rc}'}", run)
    text = run.procs.text(reader)
    events = re.findall(r"Event: (\w+)\s*\n.*?Value: (\d+)", text)
    total = re.search(r"Total events read: (\d+)", text)
    sums, counts = {}, {}
    for name, value in events:
        sums[name] = sums.get(name, 0) + int(value)
        counts[name] = counts.get(name, 0) + 1
    expect = re.search(r"^expect: (.*)$", run.procs.text(producer), re.M)
    if not expect:
        return fail("the producer did not say what to expect", run)
    wrong = []
    for item in expect.group(1).split():
        name, _, want = item.partition("=")
        want_sum, _, want_count = want.partition("/")
        got = (str(sums.get(name, 0)) if want_sum != "*" else "*", str(counts.get(name, 0)))
        if got != (want_sum, want_count):
            wrong.append(f"{name}: {sums.get(name, 0)} in {counts.get(name, 0)} events, want {want}")
    if not total or int(total.group(1)) != len(events):
        wrong.append(f"'Total events read' {total.group(1) if total else 'missing'}, {len(events)} events printed")
    if wrong:
        return fail("; ".join(wrong), run)
    return True, f"{len(events)} events"


class Suite:
    def __init__(self, src, work, etcd_bin, no_etcd):
        self.src, self.work = src, work
        self.etcd_bin, self.no_etcd, self.etcd = etcd_bin, no_etcd, None
        self.torch = subprocess.run([PY, "-c", "import torch"], capture_output=True).returncode == 0

    def start_etcd(self):
        """Starts etcd for the etcd case; on failure that case says SKIP."""
        if not self.etcd_bin:
            return
        self.etcd = Etcd(self.etcd_bin, self.work)
        why = self.etcd.start()
        if why:
            self.etcd_bin, self.no_etcd, self.etcd = "", why, None

    def etcd_url(self):
        return self.etcd.url

    def cases(self):
        no_torch = ("it needs torch, which this venv lacks (torch 2.8 with cu128 is the newest that imports "
                    "beside nixl-cu12; see the head of scripts/nixl-peer-tests)")
        no_etcd = self.no_etcd if not self.etcd_bin else None
        return [
            # name, reference backends, why it is skipped (or None), function
            ("test_nixl_bindings.py", "UCX+POSIX", None, case_pytest("test/python/test_nixl_bindings.py")),
            ("test_nixl_api.py", "UCX", None, case_pytest("test/python/test_nixl_api.py")),
            ("basic_two_peers.py", "UCX", None if self.torch else no_torch,
             two_peers("basic_two_peers.py", "Running test with tensor shape",
                       ["initiator Data verification passed", "Test Complete."], ["Test Complete."])),
            ("expanded_two_peers.py", "UCX", None if self.torch else no_torch,
             two_peers("expanded_two_peers.py", "Running test with tensor shape",
                       ["Initiator final data verification passed", "Test Complete."],
                       ["Target data verification passed", "Test Complete."])),
            ("partial_md_example.py (listener)", "UCX", None, case_partial_md_listener),
            ("partial_md_example.py (etcd)", "UCX", no_etcd, case_partial_md_etcd),
            ("query_mem_example.py", "POSIX", None, case_query_mem),
            ("remote_storage_example (CPU)", "UCX+POSIX", None, case_remote_storage),
            ("telemetry_reader.py", "UCX", None, case_telemetry),
        ]

    def run_case(self, fn, ours):
        folder = tempfile.mkdtemp(prefix=("ours-" if ours else "reference-"), dir=self.work)
        run = Run(self, ours, folder)
        try:
            return fn(run)
        except Exception as e:  # a broken step of ours (or of the setup) fails the run
            return fail(f"the runner failed: {type(e).__name__}: {e}", run)
        finally:
            run.procs.end()
            sweep_shm()
            if os.environ.get("NIXL_PEER_KEEP") != "1":
                shutil.rmtree(folder, ignore_errors=True)

    def stop(self):
        if self.etcd:
            self.etcd.stop()


def indent(text):
    return "\n".join("    " + line for line in text.strip().splitlines())


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nixl-src", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--etcd", default="")
    ap.add_argument("--no-etcd", default="etcd is not available")
    ap.add_argument("--summary", help="also write the closing line to this file")
    ap.add_argument("only", nargs="*")
    args = ap.parse_args(argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    suite = Suite(args.nixl_src, args.work, args.etcd, args.no_etcd)
    passed = failed = 0
    def wanted(name):
        return not args.only or any(name.startswith(o) for o in args.only)

    try:
        if wanted("partial_md_example.py (etcd)"):
            suite.start_etcd()
        for name, ref_backends, skip, fn in suite.cases():
            if not wanted(name):
                continue
            if skip:
                print(f"SKIP {name}: {skip}", flush=True)
                continue
            start = time.monotonic()
            ok, detail = suite.run_case(fn, ours=True)
            ref_ok, ref_detail = suite.run_case(fn, ours=False)
            took = time.monotonic() - start
            ref = f"reference {ref_backends}: {'PASS' if ref_ok else 'FAIL'}"
            if ok:
                passed += 1
                print(f"PASS {name}{': ' + detail if detail else ''} ({ref}) [{took:.0f} s]", flush=True)
            else:
                failed += 1
                first, _, rest = detail.partition("\n")
                also = "; reference also fails: environment or NIXL" if not ref_ok else ""
                print(f"FAIL {name}: {first} ({ref}{also}) [{took:.0f} s]", flush=True)
                if rest.strip():
                    print(indent(rest), flush=True)
            if not ref_ok:
                first, _, rest = ref_detail.partition("\n")
                print(f"  the reference ({ref_backends}) failed: {first}", flush=True)
                if rest.strip():
                    print(indent(rest), flush=True)
    except Exception:  # a bug of ours: say so, and count it
        import traceback

        traceback.print_exc()
        failed += 1
    finally:
        suite.stop()
    line = f"nixl peer tests: {passed} passed, {failed} failed"
    print(line, flush=True)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
