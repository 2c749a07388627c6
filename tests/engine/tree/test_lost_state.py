"""A state without a manifest to go by (lost, or unreadable): apply and revert rebuild it from proof alone (pip's
bytes from backups RECORD's sha256 proves, or from the release wheel), or refuse; status says which."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.engine.pipeline.test_crash import _killed_run
from tests.engine.pipeline.test_upgrades import _pip_target
from tests.releases import content_snapshot, stat_snapshot, wheel, wheel_file

# -- a state without a manifest to go by: rebuilt from proof, or refused; status says which -----------------------
STATE = Path(".patch-dsv4")
V41_VL_MODEL = "vllm/models/deepseek_v41/nvidia/vl_model.py"


def _same_as_pristine(tree: Path, version: str, *left_out: str) -> str:
    """What ``diff -r`` finds between ``tree`` and the release as pip installed it ("" for nothing)."""
    from tests.releases import pristine_tree

    ignored = [arg for name in ("__pycache__", ".complete", *left_out) for arg in ("-x", name)]
    found = subprocess.run(["diff", "-r", *ignored, str(pristine_tree(version)), str(tree)], capture_output=True)
    return found.stdout.decode(errors="replace") + found.stderr.decode(errors="replace")


def _lost_note(cli, tree: Path) -> str:
    """status's one note about the state without a manifest (it reports the tree: exit 0)."""
    status = cli("status", "--site-packages", tree, "--json")
    assert status.code == 0, status.stderr
    notes = status.json()["notes"]
    (note,) = [n for n in notes if ("state" in n or STATE.name in n) and ("revert" in n or "apply" in n)]
    return note


def _error(result) -> str:
    from tests.errors import error_lines

    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "version, opt_in", [("0.30.0", ()), ("0.34.0", ("dense-exl3",))], ids=["vllm-0.30.0", "vllm-0.34.0-dense-exl3"]
)
def test_a_lost_manifest_is_rebuilt_from_the_backups_and_reverts_byte_for_byte(version, opt_in, make_tree, cli):
    tree = make_tree(version)
    applied = cli("apply", "--site-packages", tree, *(a for i in opt_in for a in ("--with", i)), "--json")
    assert applied.code == 0 and applied.json()["changed_files"], applied.stderr
    written = json.loads((tree / STATE / "manifest.json").read_text())
    if version == "0.30.0":
        assert V41_VL_MODEL in written["files"]  # V4.1's files are patched (and rebuilt) too
    (tree / STATE / "manifest.json").unlink()

    note = _lost_note(cli, tree)  # what status says the next apply does ...
    assert note == (
        "the state has no manifest: the next apply or revert rebuilds it: pip's bytes from their backups in"
        " .patch-dsv4/backups/, proven by RECORD's sha256, and each file what the patches write on them"
    )
    rebuilt = cli("apply", "--site-packages", tree, "--json")  # ... is what it does (no --with: the state keeps it)
    assert rebuilt.code == 0, rebuilt.stderr
    assert rebuilt.json()["notes"][0] == (
        f"rebuilt the state ({len(written['files'])} file(s), vLLM {version}): pip's bytes from their backups in"
        " .patch-dsv4/backups/, proven by RECORD's sha256, and each file what the patches write on them"
    )
    assert rebuilt.json()["changed_files"] == [] and rebuilt.verdicts() == applied.verdicts()
    manifest = json.loads((tree / STATE / "manifest.json").read_text())
    assert manifest["files"] == written["files"] and manifest["opt_in"] == list(opt_in)
    assert manifest["vllm_version"] == version
    assert cli("verify", "--site-packages", tree).code == 0
    before = content_snapshot(tree, ".patch-dsv4") | content_snapshot(tree, "vllm")
    assert cli("apply", "--site-packages", tree).code == 0  # a second apply changes nothing
    assert content_snapshot(tree, ".patch-dsv4") | content_snapshot(tree, "vllm") == before
    assert cli("revert", "--site-packages", tree).code == 0
    assert _same_as_pristine(tree, version) == ""


def test_a_lost_state_missing_a_backup_takes_pip_bytes_from_the_wheel(make_tree, cli, monkeypatch):
    from tests.releases import cache_dir

    monkeypatch.setenv("PATCH_DSV4_CACHE", str(cache_dir()))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    wheel("vllm", "0.30.0")
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / STATE / "manifest.json").unlink()
    (tree / STATE / "backups" / V41_VL_MODEL).unlink()
    proof = "pip's bytes from 4 backup(s) in .patch-dsv4/backups/, the vllm==0.30.0 wheel, proven by RECORD's sha256"
    assert f"the next apply or revert rebuilds it: {proof}" in _lost_note(cli, tree)
    reverted = cli("revert", "--site-packages", tree, "--json")
    assert reverted.code == 0, reverted.stderr
    assert reverted.json()["notes"][0].startswith(f"rebuilt the state (5 file(s), vLLM 0.30.0): {proof}")
    assert len(reverted.json()["changed_files"]) == 5 and _same_as_pristine(tree, "0.30.0") == ""


def test_an_interrupted_first_apply_leaves_a_state_the_next_apply_removes(make_tree, cli):
    """Backups written, no manifest yet, no file changed: status says apply removes it, and apply does."""
    done = make_tree("0.30.0")
    assert cli("apply", "--site-packages", done).code == 0
    tree = make_tree("0.30.0")
    shutil.copytree(done / STATE / "backups", tree / STATE / "backups")
    assert _lost_note(cli, tree).startswith(
        "an apply was interrupted before it changed a file: .patch-dsv4/ holds what it prepared, which the next"
        " apply or revert removes"
    )
    dry = cli("apply", "--site-packages", tree, "--dry-run", "--json")
    assert dry.json()["notes"][0] == "would remove .patch-dsv4/ without a manifest: no file carries patch-dsv4's edits"
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0
    assert applied.json()["notes"][0] == "removed .patch-dsv4/ without a manifest: no file carries patch-dsv4's edits"
    assert content_snapshot(tree, "vllm") == content_snapshot(done, "vllm")  # then applied, as usual
    assert cli("revert", "--site-packages", tree).code == 0 and _same_as_pristine(tree, "0.30.0") == ""


@pytest.mark.parametrize("damage", ["a backup of another release", "an edit beside ours"])
def test_a_lost_state_without_proof_is_refused_as_status_said_and_the_way_out_works(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / STATE / "manifest.json").unlink()
    if damage == "a backup of another release":  # what revert would restore is not this release's file (0.31.0
        #   and 0.32.0 ship 0.30.0's bytes of it)
        (tree / STATE / "backups" / VL_MODEL).write_bytes(wheel_file("0.33.0", VL_MODEL))
        why = f"{VL_MODEL} carries patch-dsv4's edits, but its backup in .patch-dsv4/backups/ is not what pip"
    else:
        with open(tree / VL_MODEL, "a") as fh:
            fh.write("# a local hotfix\n")
        why = f"{VL_MODEL} carries patch-dsv4's edits, but it is neither pip's bytes nor what the patches write"
    reinstall = f"pip install --no-deps --force-reinstall --upgrade --target {tree} vllm==0.30.0"
    note = _lost_note(cli, tree)
    assert note.startswith(f"the state has no manifest: the next apply or revert refuses to rebuild it: {why}")
    assert note.endswith(f"(next: {reinstall}, then patch-dsv4 apply --site-packages {tree})")
    before = stat_snapshot(tree)
    for command in ("apply", "revert"):
        line = _error(cli(command, "--site-packages", tree))
        assert line.startswith(
            f"patch-dsv4: error: cannot rebuild the state {tree / STATE}: it has no manifest, and {why}"
        ), line
        assert line.endswith(f"(next: {reinstall}, then patch-dsv4 {command} --site-packages {tree})"), line
    assert stat_snapshot(tree) == before
    kept = (tree / STATE / "backups" / VL_MODEL).read_bytes()
    _pip_target(tree, "0.30.0")  # the way out it names
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0, applied.stderr
    if damage == "a backup of another release":  # never restored, never lost: set aside
        assert (
            "1 backup(s) that are not their file's bytes kept in .patch-dsv4/saved-edits/" in applied.json()["notes"][0]
        )
        (aside,) = (tree / STATE / "saved-edits").glob(f"*/backups/{VL_MODEL}")
        assert aside.read_bytes() == kept
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert _same_as_pristine(tree, "0.30.0", ".patch-dsv4", "bin", "vllm-0.30.0.dist-info") == ""  # pip rewrote those


@pytest.mark.parametrize("wheel_cached", [True, False], ids=["wheel-cached", "no-wheel"])
def test_no_state_at_all_is_left_by_apply_and_rebuilt_by_revert(wheel_cached, make_tree, cli, monkeypatch, tmp_path):
    """Our edits, no state directory (a copied tree): apply leaves it as it finds it (it fetches nothing for a
    state that was never here); revert rebuilds it first, from the release's wheel, or refuses; status says which."""
    from tests.releases import cache_dir

    monkeypatch.setenv("PATCH_DSV4_CACHE", str(cache_dir() if wheel_cached else tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    if wheel_cached:
        wheel("vllm", "0.30.0")
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    shutil.rmtree(tree / STATE)
    lead = "no state names the files that carry patch-dsv4's edits (apply leaves it so): the next revert"
    note = _lost_note(cli, tree)
    before = stat_snapshot(tree)
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0 and not any("rebuil" in n for n in applied.json()["notes"])
    assert stat_snapshot(tree) == before
    reverted = cli("revert", "--site-packages", tree, "--json")
    if wheel_cached:
        assert note.startswith(f"{lead} rebuilds it: pip's bytes from the vllm==0.30.0 wheel, proven by RECORD's")
        assert reverted.code == 0, reverted.stderr
        assert reverted.json()["notes"][0].startswith("rebuilt the state (5 file(s), vLLM 0.30.0): pip's bytes from")
        assert _same_as_pristine(tree, "0.30.0") == ""
    else:
        assert note.startswith(f"{lead} rebuilds it once it has fetched the vllm==0.30.0 wheel with pip")
        assert "(where pip cannot fetch it, it refuses: reinstall vLLM)" in note
        assert reverted.code == 2
        line = _error(reverted)
        assert f"cannot rebuild the state {tree / STATE}: there is none, and " in line
        assert "carries patch-dsv4's edits, but no backup holds pip's bytes: cannot fetch vllm==0.30.0 with pip" in line
        assert line.endswith(f"vllm==0.30.0, then patch-dsv4 revert --site-packages {tree})")
        assert stat_snapshot(tree) == before


@pytest.mark.slow
def test_a_rebuild_killed_at_every_step_is_finished_by_the_next_apply(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / STATE / "manifest.json").write_text("{")
    patched = content_snapshot(tree, "vllm")
    step = 0
    while True:
        step += 1
        code = _killed_run(step, "apply", "--site-packages", tree)
        assert content_snapshot(tree, "vllm") == patched, step  # a rebuild writes nothing of vLLM's
        if code == 0:
            break
        assert code == -9, f"step {step}: exit {code}"
        assert cli("apply", "--site-packages", tree).code == 0, step
        assert cli("verify", "--site-packages", tree).code == 0, step
        assert len(list((tree / STATE / "saved-edits").glob("*/manifest.json.unreadable"))) == 1, step
        (tree / STATE / "manifest.json").unlink()  # lost again, for the next step
        shutil.rmtree(tree / STATE / "saved-edits")
        (tree / STATE / "manifest.json").write_text("{")
    assert step > 5, "the fault hook never fired: nothing was tested"
    assert cli("revert", "--site-packages", tree).code == 0
    assert _same_as_pristine(tree, "0.30.0", ".patch-dsv4") == ""
