"""Upgrades and reinstalls over a patched tree, and the bytecode apply and revert leave."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import DSV4, wheel, wheel_file


def _pip_target(tree: Path, version: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            str(tree),
            str(wheel("vllm", version)),
        ],
        check=True,
        capture_output=True,
    )


@pytest.mark.slow
def test_upgrade_over_a_patched_tree(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    _pip_target(tree, "0.31.0")  # what an image rebuild or `pip install -U` does

    status = cli("status", "--site-packages", tree, "--json")
    assert status.json()["vllm_version"] == "0.31.0"
    assert status.json()["state"] == "stale"
    assert status.verdicts()["stream-load"] == "pending"
    assert any("stale" in note for note in status.json()["notes"])
    assert cli("verify", "--site-packages", tree).code == 1

    # revert must not put 0.30.0's file back into 0.31.0
    reverted = cli("revert", "--site-packages", tree, "--json")
    assert reverted.code == 0
    assert reverted.json()["changed_files"] == []
    assert (tree / VL_MODEL).read_bytes() == wheel_file("0.31.0", VL_MODEL)
    assert not (tree / ".patch-dsv4").exists()

    # a stale state left in place is replaced by a clean apply
    assert cli("apply", "--site-packages", tree).code == 0
    _pip_target(tree, "0.30.0")
    _pip_target(tree, "0.31.0")
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0
    assert applied.json()["state"] == "current"
    assert applied.verdicts()["stream-load"] == "applied"
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert (tree / VL_MODEL).read_bytes() == wheel_file("0.31.0", VL_MODEL)


@pytest.mark.slow
def test_upgrade_to_034_needs_nothing(make_tree, cli):
    """A Dockerfile that ran `apply && verify` on 0.32.0 keeps working after `pip install -U` to 0.34.0: every
    default fix is upstream there, the stale state is reported and replaced, nothing is written into vLLM."""
    tree = make_tree("0.32.0")
    assert cli("apply", "--site-packages", tree).code == 0
    _pip_target(tree, "0.34.0")
    status = cli("status", "--site-packages", tree, "--json")
    assert status.json()["state"] == "stale"
    assert {status.verdicts()[p] for p in ("stream-load", "dtype-policy", "loader-skips", "wide-swa")} == {"upstream"}
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0, applied.stderr
    assert applied.json()["changed_files"] == []
    assert cli("verify", "--site-packages", tree).code == 0
    assert (tree / VL_MODEL).read_bytes() == wheel_file("0.34.0", VL_MODEL)


@pytest.mark.slow
def test_reinstall_of_the_same_release_makes_state_stale(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    _pip_target(tree, "0.30.0")
    status = cli("status", "--site-packages", tree, "--json")
    assert status.json()["state"] == "stale"
    assert status.verdicts()["stream-load"] == "pending"
    assert cli("apply", "--site-packages", tree).code == 0
    assert cli("verify", "--site-packages", tree).code == 0


def _pycs_of(path: Path) -> list[Path]:
    return sorted((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"))


def test_no_stale_bytecode_after_apply_or_revert(make_tree, cli):
    tree = make_tree("0.30.0")
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", str(tree / DSV4)],
        check=True,
    )
    target = tree / VL_MODEL
    assert _pycs_of(target)
    untouched = tree / DSV4 / "nvidia" / "vl_model.py"
    untouched_pycs = _pycs_of(untouched)
    assert cli("apply", "--site-packages", tree).code == 0
    assert _pycs_of(target) == []
    assert _pycs_of(untouched) == untouched_pycs  # only what changed loses its bytecode
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", str(target)], check=True
    )
    assert cli("revert", "--site-packages", tree).code == 0
    assert _pycs_of(target) == []
