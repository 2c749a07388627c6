"""examples/spark-vllm-docker/mods/patch-dsv4/run.sh, run as launch-cluster.sh runs a mod (no arguments), against a
real release tree: it installs this project's wheel from the wheels vendored beside it, with no index, applies and
verifies with PATCH_DSV4_WITH's opt-ins, and stops the launch (non-zero) on any refusal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.releases import cache_dir, cache_lock, hand_edit, pip_fetch

ROOT = Path(__file__).resolve().parents[2]
MOD = ROOT / "examples" / "spark-vllm-docker" / "mods" / "patch-dsv4"
DEPENDENCIES = ("libcst>=1.1", "typer>=0.12", "rich>=13", "packaging>=23")


def _dependency_wheels() -> Path:
    """patch-dsv4's dependencies as wheels for this interpreter's platform (pip download, once, cached)."""
    where = cache_dir() / "mod-wheels" / f"py{sys.version_info.major}{sys.version_info.minor}"
    with cache_lock("mod-wheels"):
        if not (where / ".complete").exists():
            shutil.rmtree(where, ignore_errors=True)
            pip_fetch(
                "patch-dsv4's dependency wheels",
                ["download", "--quiet", "--only-binary=:all:", "-d", str(where), *DEPENDENCIES],
            )
            (where / ".complete").write_text("")
    return where


@pytest.fixture(scope="module")
def mod(tmp_path_factory) -> dict[str, str]:
    """A copy of the mod folder with its wheels vendored (this checkout's wheel, built here), and a fresh venv
    standing for the container's Python."""
    base = tmp_path_factory.mktemp("mod")
    folder = base / "patch-dsv4"
    shutil.copytree(MOD, folder)
    wheels = folder / "wheels"
    wheels.mkdir()
    source = base / "source"  # built from a copy: no build/ or egg-info left in the checkout
    skipped = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, source, ignore=skipped)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
        + [str(source)],
        check=True,
        capture_output=True,
    )
    for wheel in _dependency_wheels().glob("*.whl"):
        shutil.copy(wheel, wheels)
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True)
    return {"run": str(folder / "run.sh"), "python": str(base / "venv" / "bin" / "python")}


def _launch(mod: dict[str, str], tree: Path, **env: str) -> subprocess.CompletedProcess:
    """run.sh with no arguments, no index and no pip configuration: only the vendored wheels can serve."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PATCH_DSV4_", "VIRTUAL_ENV"))}
    clean.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PATCH_DSV4_PYTHON=mod["python"])
    clean.update(PATCH_DSV4_SITE_PACKAGES=str(tree), **env)
    return subprocess.run(["bash", mod["run"]], capture_output=True, text=True, env=clean, timeout=600)


def _manifest(tree: Path) -> dict:
    return json.loads((tree / ".patch-dsv4" / "manifest.json").read_text())


def test_the_mod_installs_from_its_wheels_applies_and_verifies_with_patch_dsv4_with(mod, make_tree, cli):
    tree = make_tree("0.30.0")
    launched = _launch(mod, tree, PATCH_DSV4_WITH="aux-streams")
    assert launched.returncode == 0, launched.stderr
    assert "installing patch-dsv4 from" in launched.stderr and "apply (opt-ins: aux-streams)" in launched.stderr
    assert _manifest(tree)["opt_in"] == ["aux-streams"]
    assert cli("verify", "--site-packages", tree).code == 0
    fingerprint = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
    assert f"this node serves {fingerprint}" in launched.stderr
    again = _launch(mod, tree, PATCH_DSV4_WITH="aux-streams", PATCH_DSV4_EXPECT=fingerprint)  # the next launch
    assert again.returncode == 0, again.stderr
    assert "it is the fingerprint PATCH_DSV4_EXPECT names" in again.stderr


def test_a_refusal_stops_the_launch(mod, make_tree):
    tree = make_tree("0.30.0")
    path = tree / "vllm/models/deepseek_v4/common/vl_model.py"
    hand_edit(path, path.read_text() + "\n# a local edit\n")
    launched = _launch(mod, tree)
    assert launched.returncode == 1, launched.stderr
    assert "refusing to patch vllm/models/deepseek_v4/common/vl_model.py" in launched.stderr
    assert "verify" not in launched.stderr.split("refusing")[1]  # it stopped at apply
    assert not (tree / ".patch-dsv4" / "manifest.json").exists()


def test_an_unknown_opt_in_and_another_fingerprint_stop_the_launch(mod, make_tree):
    tree = make_tree("0.30.0")
    unknown = _launch(mod, tree, PATCH_DSV4_WITH="aux-stream")
    said = unknown.stderr.replace("\npatch-dsv4:   ", " ")  # lines folded to 80 columns
    assert unknown.returncode == 2 and "PATCH_DSV4_WITH=aux-stream: no opt-in patch aux-stream" in said
    assert not (tree / ".patch-dsv4").exists()
    other = _launch(mod, tree, PATCH_DSV4_EXPECT="dsv4:1:aaaaaaaaaaaa:vllm-0.30.0:fi-none:aaaaaaaa::")
    assert other.returncode == 1, other.stderr
    assert "fingerprint differs from the expected one" in other.stderr


def test_the_mod_without_its_wheels_says_what_to_do(tmp_path, make_tree):
    launched = _launch(
        {"run": str(MOD / "run.sh"), "python": sys.executable}, make_tree("0.30.0"), PATCH_DSV4_WHEELS=str(tmp_path)
    )
    assert launched.returncode == 2 and "vendor it first" in launched.stderr
