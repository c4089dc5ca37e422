#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The child side of scripts/nixl-peer-tests: what runs inside each process
that runs one of NIXL's files (peer_run.py starts them).

    peer_env.py SCRIPT [ARG...]        runs SCRIPT as __main__ (the launcher)
    python -m pytest -p peer_env ...   the same environment as a pytest plugin

Two environment variables, set by peer_run.py:

ORBITE_PEER_OURS=1
    Our run: NIXL's default backend list (nixl_agent_config's backends=
    ["UCX"], used by every agent made without an explicit list) becomes
    ["ORBITE"], in this process only. NIXL's files are not touched. And a
    guard: creating NIXL's own UCX or POSIX raises (a name the swap missed
    would otherwise pass on NIXL's backend, found in the same plugin folder).
ORBITE_PEER_TORCH_STANDIN=1
    The venv has no torch: `import torch` gives a stand-in module whose only
    member is an empty class Tensor (so NIXL's "is this a tensor" checks say
    no) and whose every other attribute raises. It lets files that import
    torch but do not use it on the path we run (test_nixl_api.py, the remote
    storage example on DRAM) be imported; under pytest, the test functions
    that name torch are deselected.

The launcher also shows the INFO lines of the examples' own loggers
(nixl.main__ and nixl.nixl_storage_utils in Python), which carry the examples' success messages ("Test Complete.",
"Data verification passed"), whatever NIXL_LOG_LEVEL says for the C++ side.

Under pytest, a test that skips itself at run time (pytest.skip() in the test
or a fixture, not a skip marker) is reported as failed: NIXL's tests fall
back that way when a backend cannot be created (test_query_mem tries
MOCK_DRAM, then skips), and that must not read as a pass.
"""

import logging
import os
import runpy
import sys
import types


def swap_default_backends():
    """NIXL's default backend list ["UCX"] -> ["ORBITE"], in place."""
    from nixl._api import nixl_agent_config

    for default in nixl_agent_config.__init__.__defaults__ or ():
        if isinstance(default, list) and default == ["UCX"]:
            default[:] = ["ORBITE"]
            return
    raise RuntimeError("peer_env: nixl_agent_config has no default backend list ['UCX'] to swap")


def guard_reference_backends():
    """In our runs, createBackend("UCX" or "POSIX") raises."""
    import nixl._bindings as bindings

    create = bindings.nixlAgent.createBackend

    def create_backend(self, name, params, *rest):
        if name in ("UCX", "POSIX"):
            raise RuntimeError(f"peer_env: our run asked for NIXL's own backend {name} (a name the swap missed)")
        return create(self, name, params, *rest)

    bindings.nixlAgent.createBackend = create_backend


def install_torch_standin():
    torch = types.ModuleType("torch")
    torch.__doc__ = "stand-in of scripts/nixl-peer-tests: torch is not installed in this venv"

    class Tensor:  # nothing is an instance of it
        pass

    def missing(name):
        raise AttributeError(f"torch.{name}: torch is not installed in this venv "
                             "(a stand-in of scripts/nixl-peer-tests)")

    torch.Tensor = Tensor
    torch.__getattr__ = missing
    sys.modules["torch"] = torch


def needs_torch(item):
    """A pytest item whose test function names torch."""
    code = getattr(getattr(item, "function", None), "__code__", None)
    return code is not None and "torch" in code.co_names


def setup():
    if os.environ.get("ORBITE_PEER_TORCH_STANDIN") == "1":
        install_torch_standin()
    if os.environ.get("ORBITE_PEER_OURS") == "1":
        swap_default_backends()
        guard_reference_backends()


# --- pytest plugin (-p peer_env) ---------------------------------------------

try:
    import pytest
except ImportError:  # the launcher does not need it
    pytest = None

if pytest is not None:

    def pytest_configure(config):
        setup()

    def pytest_collection_modifyitems(config, items):
        if os.environ.get("ORBITE_PEER_TORCH_STANDIN") != "1":
            return
        drop = [item for item in items if needs_torch(item)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if item not in drop]
            for item in drop:
                print(f"peer_env: deselected {item.nodeid}: it uses torch, not installed in this venv")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(item, call):
        report = yield
        if report.skipped and call.when in ("setup", "call") and not hasattr(report, "wasxfail"):
            if item.get_closest_marker("skip") is None and item.get_closest_marker("skipif") is None:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                report.outcome = "failed"
                report.longrepr = f"skipped itself at run time ({reason}); the peer tests count that as a failure"
        return report


# --- launcher ------------------------------------------------------------------

def main(argv):
    if len(argv) < 2:
        sys.exit("usage: peer_env.py SCRIPT [ARG...]")
    script = os.path.abspath(argv[1])
    setup()
    # As `python SCRIPT`: its folder first on sys.path, its arguments.
    sys.path[0] = os.path.dirname(script)
    sys.argv = [script] + argv[2:]
    from nixl.logging import setup_logging

    setup_logging()  # NIXL's configuration first, then the examples' INFO
    # get_logger("__main__") is nixl.main__ (only leading "_" are stripped).
    for name in ("nixl.main__", "nixl.nixl_storage_utils"):
        logging.getLogger(name).setLevel(logging.INFO)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
