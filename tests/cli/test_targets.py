"""The environment a command acts on: another venv with --python, and the running interpreter's by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.conftest import ROOT
from tests.engine.pipeline.test_upgrades import _pip_target
from tests.releases import wheel_file


@pytest.mark.slow
def test_python_option_acts_on_another_venv(tmp_path, cli):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    _pip_target(site, "0.32.0")
    status = cli("status", "--python", python, "--json")
    assert status.code == 0, status.stderr
    assert status.json()["vllm_version"] == "0.32.0"
    assert Path(status.json()["target"]) == site
    assert status.verdicts()["stream-load"] == "pending"
    assert cli("apply", "--python", python).code == 0
    assert cli("verify", "--python", python).code == 0
    assert cli("revert", "--python", python).code == 0
    assert (site / VL_MODEL).read_bytes() == wheel_file("0.32.0", VL_MODEL)


def test_python_option_bad_interpreter(tmp_path, cli):
    result = cli("status", "--python", tmp_path / "no-python")
    assert result.code == 2
    assert "cannot run" in result.stderr


@pytest.mark.slow
def test_default_target_is_the_running_interpreters_environment(make_tree):
    """Without --site-packages or --python, vLLM is found on this interpreter's sys.path (never imported)."""
    tree = make_tree("0.31.0")
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    run = [sys.executable, "-m", "patch_dsv4"]
    status = subprocess.run([*run, "status", "--json"], env=env, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["vllm_version"] == "0.31.0" and Path(data["target"]) == tree
    assert subprocess.run([*run, "apply"], env=env, capture_output=True).returncode == 0
    assert subprocess.run([*run, "verify"], env=env, capture_output=True).returncode == 0
    assert subprocess.run([*run, "revert"], env=env, capture_output=True).returncode == 0
    assert (tree / VL_MODEL).read_bytes() == wheel_file("0.31.0", VL_MODEL)
