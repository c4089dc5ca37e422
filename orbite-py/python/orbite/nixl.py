# SPDX-License-Identifier: Apache-2.0
"""OrbiTE as a NIXL backend: the plugin files this wheel carries, putting
them where an installed NIXL looks, and a check of the whole path.

    python -m orbite.nixl install     # once, after `pip install nixl orbite`
    python -m orbite.nixl doctor

After `install()`, an unmodified vLLM (or SGLang, Dynamo) that creates a
NIXL agent with `backends=["ORBITE"]` finds the backend, with no
environment variable: NIXL loads the plugins in the `plugins` folder next
to its own library, and the plugin finds `liborbite_nixl.so.1` beside it.
"""

import ctypes
import glob
import os
import shutil
import site
import sys
import sysconfig

from orbite._orbite import OrbiteError

# What a wheel built with the plugin carries, in `orbite/_nixl/`.
PLUGINS = ("libplugin_ORBITE.so", "libplugin_ORBITE_FILE.so")
LIBRARY = "liborbite_nixl.so.1"

__all__ = ["plugin_dir", "nixl_plugin_dir", "install", "doctor", "Report"]


def plugin_dir():
    """The folder of the NIXL plugin files this wheel carries, or None if
    it was built without them."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nixl")
    if all(os.path.isfile(os.path.join(here, f)) for f in PLUGINS + (LIBRARY,)):
        return here
    return None


def _site_dirs():
    dirs = []
    for d in [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]:
        if d:
            dirs.append(d)
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    out = []
    for d in dirs:
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def nixl_plugin_dir():
    """Where the installed NIXL wheel loads its plugins from (the `plugins`
    folder next to its `libnixl.so`), or None if no NIXL is installed in
    this environment. `NIXL_PLUGIN_DIR`, when set, is where NIXL looks
    instead."""
    for d in _site_dirs():
        for lib in sorted(glob.glob(os.path.join(d, ".nixl*.libs", "libnixl.so"))
                          + glob.glob(os.path.join(d, "nixl*.libs", "libnixl.so"))):
            plugins = os.path.join(os.path.dirname(lib), "plugins")
            if os.path.isdir(plugins):
                return plugins
    return None


def install(target=None):
    """Copies the ORBITE and ORBITE_FILE plugins and `liborbite_nixl.so.1`
    into `target`, by default the installed NIXL's plugin folder, replacing
    older copies; returns the paths written. Raises OrbiteError when this
    wheel carries no plugin or no NIXL is installed."""
    src = plugin_dir()
    if src is None:
        raise OrbiteError("this orbite wheel was built without the NIXL plugin (see docs/python.md)")
    target = target or nixl_plugin_dir()
    if target is None:
        raise OrbiteError("no NIXL is installed in this environment (pip install nixl)")
    written = []
    for f in (LIBRARY,) + PLUGINS:
        dst = os.path.join(target, f)
        tmp = dst + ".orbite-new"
        shutil.copyfile(os.path.join(src, f), tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)  # atomic: a NIXL loading now sees old or new
        written.append(dst)
    return written


class Report:
    """What `doctor()` found: `checks`, a list of `(name, ok, detail)`;
    `ok` when every check passed."""

    def __init__(self):
        self.checks = []

    def add(self, name, ok, detail=""):
        self.checks.append((name, bool(ok), detail))
        return ok

    @property
    def ok(self):
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def __str__(self):
        lines = [f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}" for name, ok, detail in self.checks]
        lines.append("ORBITE works through NIXL" if self.ok else "ORBITE does not work through NIXL yet")
        return "\n".join(lines)

    def __repr__(self):
        return f"Report(ok={self.ok}, checks={self.checks!r})"


class _AbiInfo(ctypes.Structure):
    """`OrbiteAbiInfo` of include/orbite/nixl.h (record version 1)."""

    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32), ("abi_major", ctypes.c_uint32),
                ("abi_minor", ctypes.c_uint32), ("features", ctypes.c_uint64)] + [
        (f"size_{i}", ctypes.c_uint32) for i in range(10)]


def _abi(path):
    """The C ABI version of a liborbite_nixl, as (major, minor)."""
    lib = ctypes.CDLL(path)
    info = _AbiInfo(size=ctypes.sizeof(_AbiInfo), version=1)
    status = lib.orbite_abi_info(ctypes.byref(info))
    if status != 0:
        raise OrbiteError(f"orbite_abi_info refused the record (status {status}): another ABI")
    return info.abi_major, info.abi_minor


def doctor(verbose=False):
    """Checks the path from NIXL to this engine and says what works: the
    NIXL version, where NIXL loads plugins from and whether ORBITE is there
    (or in this wheel), the plugin's C ABI, an agent created as vLLM creates
    it (`backends=["ORBITE"]`), and a loopback WRITE through it whose bytes
    are checked. Returns a `Report` (printed too when `verbose`)."""
    r = Report()
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("nixl")
        except PackageNotFoundError:
            v = None
        r.add("NIXL installed", v is not None, f"nixl {v}" if v else "pip install nixl")
        if v is None:
            return _done(r, verbose)
        env_dir = os.environ.get("NIXL_PLUGIN_DIR")
        where = env_dir or nixl_plugin_dir()
        has = where is not None and os.path.isfile(os.path.join(where, PLUGINS[0]))
        detail = f"{where} ({'NIXL_PLUGIN_DIR' if env_dir else 'next to libnixl.so'})"
        if not has:
            detail += "; run orbite.nixl.install()" if plugin_dir() else "; this wheel carries no plugin"
        if not r.add("ORBITE plugin where NIXL looks", has, detail):
            return _done(r, verbose)
        lib = os.path.join(where, LIBRARY)
        if os.path.isfile(lib):
            major, minor = _abi(lib)
            r.add("plugin C ABI", major == 1, f"{major}.{minor} (this package speaks 1.x)")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            r.add("NIXL Python API", False, str(e))
            return _done(r, verbose)
        agent = nixl_agent("orbite-doctor", nixl_agent_config(backends=["ORBITE"]))
        plugins = agent.get_plugin_list()
        made = "ORBITE" in getattr(agent, "backends", {})
        if not r.add("agent with backends=['ORBITE']", made,
                     "backend created" if made else f"not created; plugins found: {sorted(plugins)}"):
            return _done(r, verbose)
        r.add("loopback WRITE through NIXL", *_loopback(agent))
    except Exception as e:  # noqa: BLE001 (a doctor reports, it does not raise)
        r.add("unexpected error", False, f"{type(e).__name__}: {e}")
    return _done(r, verbose)


def _loopback(agent):
    import time

    n = 1 << 20
    src = bytearray(os.urandom(n))
    dst = bytearray(n)
    addr = [ctypes.addressof((ctypes.c_char * n).from_buffer(b)) for b in (src, dst)]
    regs = [agent.register_memory([(a, n, 0, "")], "DRAM") for a in addr]
    try:
        local = agent.get_xfer_descs([(addr[0], n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(addr[1], n, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, remote, agent.name)
        state = agent.transfer(h)
        deadline = time.monotonic() + 10
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        ok = state == "DONE" and dst == src
        return ok, f"1 MiB, state {state}, bytes {'match' if dst == src else 'differ'}"
    finally:
        for reg in regs:
            agent.deregister_memory(reg)


def _done(r, verbose):
    if verbose:
        print(r)
    return r


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install"]:
        for p in install(argv[1] if len(argv) > 1 else None):
            print(f"installed {p}")
        return 0
    if argv[:1] == ["doctor"]:
        return 0 if doctor(verbose=True).ok else 1
    if argv[:1] == ["plugin-dir"]:
        print(plugin_dir() or "")
        return 0 if plugin_dir() else 1
    print("usage: python -m orbite.nixl {install [DIR] | doctor | plugin-dir}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
