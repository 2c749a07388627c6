"""The test suite's own promises: the slow kill and fault tests carry their marker, a wheel pip cannot
fetch skips the test naming it (or fails it where CI asks), and a module that builds no release tree
fetches nothing on a cold cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import releases
from tests.conftest import ROOT

KILL_AND_FAULT = {
    "tests/engine/pipeline/test_crash.py::test_apply_killed_at_every_step",
    "tests/engine/pipeline/test_crash.py::test_revert_killed_at_every_step",
    "tests/engine/pipeline/test_write_failures.py::test_apply_fails_at_every_write_step",
    "tests/engine/pipeline/test_write_failures.py::test_apply_over_an_earlier_apply_fails_at_every_write_step",
    "tests/engine/pipeline/test_write_failures.py::test_revert_fails_at_every_write_step",
    "tests/engine/pipeline/test_concurrency.py::test_eight_ranks_apply_at_once",
    "tests/engine/tree/test_hostile_state.py::test_every_cpython_reads_the_hostile_state_the_same",
}
NO_TREE = ("tests/engine/patching/test_registry.py", "tests/engine/patching/test_evaluate.py")


def _offline_env(cache: Path) -> dict[str, str]:
    """An empty test cache, and pip pointed at a closed local port with no other source."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != releases.REQUIRE_WHEELS}
    env.update(
        PATCH_DSV4_TEST_CACHE=str(cache),
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_CONFIG_FILE=os.devnull,
        PIP_RETRIES="0",
    )
    return env


def _pytest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )


def test_the_kill_and_fault_tests_are_marked_slow():
    ran = _pytest("--collect-only", "-m", "slow", "tests/engine")
    slow = {line.split("[")[0] for line in ran.stdout.splitlines() if "::" in line}
    assert KILL_AND_FAULT <= slow, sorted(KILL_AND_FAULT - slow)
    quick = _pytest("--collect-only", "-m", "not slow", "tests/engine")
    assert not {line.split("[")[0] for line in quick.stdout.splitlines() if "::" in line} & KILL_AND_FAULT


def test_a_wheel_pip_cannot_fetch_skips_naming_it_unless_required(monkeypatch, tmp_path):
    for key, value in _offline_env(tmp_path / "cache").items():
        if not key.startswith("PIP_"):
            monkeypatch.setenv(key, value)
    offline = {k: v for k, v in _offline_env(tmp_path).items() if k.startswith("PIP_")}
    monkeypatch.setattr(releases, "PIP_SETTINGS", offline)  # pip as the session began: no index it can reach
    monkeypatch.delenv(releases.REQUIRE_WHEELS, raising=False)
    monkeypatch.setattr(releases, "_unfetchable", {})
    with pytest.raises(pytest.skip.Exception) as skipped:
        releases.pristine_tree("0.30.0")
    reason = str(skipped.value)
    assert "the vllm 0.30.0 wheel is not in the test cache" in reason and "pip could not fetch it" in reason
    monkeypatch.setenv(releases.REQUIRE_WHEELS, "1")
    with pytest.raises(RuntimeError, match="the vllm 0.30.0 wheel is not in the test cache"):
        releases.wheel("vllm", "0.30.0")
    assert not list((tmp_path / "cache").rglob("*.whl"))


def test_a_module_that_builds_no_release_tree_fetches_nothing_on_a_cold_cache(tmp_path):
    cache = tmp_path / "cache"
    ran = _pytest(*NO_TREE, env=_offline_env(cache))
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert "skipped" not in ran.stdout.splitlines()[-1], ran.stdout[-500:]
    assert not (cache / "wheels").exists() and not (cache / "trees").exists()
    marked = _pytest("--collect-only", "-m", "wheels", *NO_TREE, env=_offline_env(cache))
    assert marked.returncode == 5, marked.stdout[-1000:]  # none of their tests is marked as needing wheels


def test_ci_runs_the_readme_command_requiring_the_wheels():
    assert f"{releases.REQUIRE_WHEELS}=1" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_ci_drifts_every_recorded_release_and_nothing_else(tmp_path):
    """.ci/run's drift loop, run as written over the checkout's anchors/ with a stand-in patch-dsv4: it is asked
    for each recorded release once (not for the probe answers recorded beside them, anchors/vllm-X.probes.json)."""
    from patch_dsv4.releases.anchors_store import recorded_versions

    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    loop = text[text.index("drift_status=0") : text.index("\ndone\n") + len("\ndone\n")]
    (tmp_path / "anchors").symlink_to(ROOT / "anchors")
    stand_in = tmp_path / ".venv" / "bin" / "patch-dsv4"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text('#!/bin/sh\necho "$3" >> asked\necho "**drift: vLLM $3**"\n')
    stand_in.chmod(0o755)
    script = f'set -u\nreports={tmp_path}\n{loop}\nexit "$drift_status"\n'
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "asked").read_text().split() == recorded_versions(ROOT / "anchors")
