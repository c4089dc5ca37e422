# SPDX-License-Identifier: Apache-2.0
"""`orbite.nixl`: the plugin files a wheel built with them carries,
`install()` into the installed NIXL wheel's plugin folder, and `doctor()`
through an unmodified NIXL agent created as vLLM creates it, with no
NIXL_PLUGIN_DIR. The test script builds the wheel with the plugin and
installs NIXL's wheel into the test venv when a NIXL source tree is
there (ORBITE_NIXL_REQUIRED); elsewhere the NIXL parts skip."""

import os
import subprocess
import sys

import pytest

import orbite
import orbite.nixl

REQUIRED = os.environ.get("ORBITE_NIXL_REQUIRED") == "1"


def test_what_the_wheel_carries_and_where_nixl_looks():
    d = orbite.nixl.plugin_dir()
    if REQUIRED:
        assert d is not None, "the wheel was built with the plugin"
    if d is not None:
        assert set(os.listdir(d)) >= set(orbite.nixl.PLUGINS + (orbite.nixl.LIBRARY,))
    if orbite.nixl.nixl_plugin_dir() is None:
        with pytest.raises(orbite.OrbiteError, match="no NIXL|without the NIXL plugin"):
            orbite.nixl.install()
        r = orbite.nixl.doctor()
        assert not r.ok and "NIXL installed" in str(r)


def test_install_into_a_folder(tmp_path):
    if orbite.nixl.plugin_dir() is None:
        pytest.skip("this wheel carries no NIXL plugin")
    written = orbite.nixl.install(str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(
        (orbite.nixl.LIBRARY,) + orbite.nixl.PLUGINS)
    again = orbite.nixl.install(str(tmp_path))  # replaces, atomically
    assert again == written


VLLM = """
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
import orbite.nixl

# vLLM's NixlConnector: backends by name, no parameters, no plugin folder.
agent = nixl_agent("vllm-like", nixl_agent_config(backends=["ORBITE"]))
assert "ORBITE" in agent.backends, agent.get_plugin_list()
report = orbite.nixl.doctor()
print(report)
assert report.ok
"""


def test_doctor_through_an_unmodified_agent_after_install():
    try:
        import nixl  # noqa: F401
    except ImportError:
        if REQUIRED:
            pytest.fail("ORBITE_NIXL_REQUIRED, and NIXL is not installed in the test venv")
        pytest.skip("NIXL is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_PLUGIN_DIR", "LD_LIBRARY_PATH")}
    before = subprocess.run([sys.executable, "-m", "orbite.nixl", "doctor"], env=env, capture_output=True, text=True)
    installed = subprocess.run([sys.executable, "-m", "orbite.nixl", "install"], env=env, capture_output=True,
                               text=True)
    assert installed.returncode == 0, installed.stderr
    after = subprocess.run([sys.executable, "-c", VLLM], env=env, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "ORBITE works through NIXL" in after.stdout
    assert "loopback WRITE through NIXL: 1 MiB, state DONE, bytes match" in after.stdout
    # Before install, the doctor said what was missing (unless an earlier
    # run of this venv had installed it).
    assert before.returncode == 0 or "run orbite.nixl.install()" in before.stdout
