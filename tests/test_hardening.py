"""Saved edits, the guard's reads, damaged metadata and state, short output, readers during a write (issue 19)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from patch_dsv4 import guard
from patch_dsv4.fastpath import quick
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.errors import error_lines
from tests.releases import hand_edit

STATE = ".patch-dsv4"
LOCK = ".patch-dsv4.lock"


def _dist_info(tree: Path) -> Path:
    (found,) = tree.glob("vllm-*.dist-info")
    return found


# -- saved edits: contained, never wider, never replaced ------------------------------------------------------
def test_a_patched_file_replaced_by_a_link_out_of_the_package_is_never_saved(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    secret = tmp_path / "secret.py"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    (tree / VL_MODEL).unlink()
    (tree / VL_MODEL).symlink_to(secret)
    refused = cli("revert", "--site-packages", tree, "--discard-local-edits")
    assert refused.code in (1, 2) and "outside the vLLM package" in refused.stderr, refused.stderr
    saved = tree / STATE / "saved-edits"
    assert not saved.exists() or not any(p.is_file() for p in saved.rglob("*"))
    assert (tree / VL_MODEL).is_symlink()  # nothing was changed


def test_a_saved_edit_keeps_the_files_mode(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# mine\n")
    (tree / VL_MODEL).chmod(0o600)
    done = cli("revert", "--site-packages", tree, "--discard-local-edits", "--json")
    assert done.code == 0, done.stderr
    (saved,) = done.json()["saved_edits"]
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600 and "# mine" in Path(saved).read_text()


def test_two_discarding_reverts_in_one_second_keep_both_edits(make_tree, cli):
    tree = make_tree("0.30.0")
    kept = []
    for mark in ("first", "second"):
        assert cli("apply", "--site-packages", tree).code == 0
        hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + f"\n# {mark}\n")
        done = cli("revert", "--site-packages", tree, "--discard-local-edits", "--json")
        assert done.code == 0, done.stderr
        kept += done.json()["saved_edits"]
    assert len(set(kept)) == 2
    assert [Path(p).read_text().rstrip().rsplit("\n", 1)[-1] for p in kept] == ["# first", "# second"]


# -- nothing the guard or a command opens can block it -------------------------------------------------------
def _returns_within(seconds: float, fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 (the test looks at what was raised)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    return box


@pytest.mark.parametrize("which", ["vllm", "flashinfer"])
def test_a_fifo_metadata_never_blocks_the_guard_or_a_command(which, make_tree):
    from patch_dsv4.tree.environment import locate_vllm

    tree = make_tree("0.30.0")
    if which == "vllm":
        metadata = _dist_info(tree) / "METADATA"
    else:
        fake = tree / "flashinfer_python-0.6.18.post1.dist-info"
        fake.mkdir()
        metadata = fake / "METADATA"
    if metadata.exists():
        metadata.unlink()
    os.mkfifo(metadata)
    _returns_within(10, lambda: quick.locate([str(tree)]))
    box = _returns_within(10, lambda: locate_vllm(site_packages=tree))
    if which == "vllm":
        assert "error" in box and "not a regular file" in str(box["error"].line())


@pytest.mark.parametrize("damage", ["absent", "directory", "fifo"])
def test_a_dist_info_without_a_usable_record_is_one_clear_line(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    record = _dist_info(tree) / "RECORD"
    record.unlink()
    if damage == "directory":
        record.mkdir()
    elif damage == "fifo":
        os.mkfifo(record)
    result = _returns_within(30, lambda: cli("status", "--site-packages", tree))["value"]
    assert result.code == 2 and result.stdout == ""
    (line,) = error_lines(result.stderr)
    assert "RECORD" in line and "reinstall vllm==0.30.0" in line and "drifted" not in line


# -- damaged state: unreadable, never an internal error -------------------------------------------------------
@pytest.mark.parametrize(
    "key, value", [("opt_in", [[1]]), ("opt_in", {"a": 1}), ("opt_in", [{}]), ("files.patches", [[]])]
)
def test_wrong_types_in_the_state_are_an_unreadable_state(key, value, make_tree, cli):
    tree = make_tree("0.28.0")
    assert cli("apply", "--site-packages", tree, "--with", "aux-streams").code == 0
    path = tree / STATE / "manifest.json"
    manifest = json.loads(path.read_text())
    if key == "files.patches":
        next(iter(manifest["files"].values()))["patches"] = value
    else:
        manifest[key] = value
    path.write_text(json.dumps(manifest))
    for command in ("status", "verify"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2 and "unreadable state" in result.stderr and "internal error" not in result.stderr
    rebuilt = cli("apply", "--site-packages", tree)  # from proof: the opt-in it finds applied is kept
    assert rebuilt.code == 0 and "rebuilt the state" in rebuilt.stdout, rebuilt.stderr
    assert json.loads(path.read_text())["opt_in"] == ["aux-streams"]
    assert cli("verify", "--site-packages", tree).code == 0


# -- short output ------------------------------------------------------------------------------------------------
def test_an_error_line_in_a_pipe_is_at_most_200_characters(make_tree):
    tree = make_tree("0.30.0")
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    out = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree), "--only", "x" * 5000],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip()
    assert all(len(line) <= 200 for line in out.stderr.splitlines()), out.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree)], capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert all(len(line) <= 200 for line in refused.stderr.splitlines()) and "next:" in refused.stderr


@pytest.mark.parametrize("command", ["status", "apply", "takeover", "verify", "revert", "drift", "doctor"])
def test_help_shows_no_python_type_names(command):
    out = subprocess.run([sys.executable, "-m", "patch_dsv4", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in ("<str>", "<path>", "<float>", "list[", "<int>", "TEXT", "FLOAT"):
        assert name not in out.stdout, (name, out.stdout)


# -- readers while another process writes ------------------------------------------------------------------------
def _hold_lock(tree: Path, seconds: float) -> subprocess.Popen:
    """Another process that holds the environment's lock, as an apply does, for ``seconds``."""
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tree / LOCK)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'pid %d since now' % os.getpid())\n"
        "print('held', flush=True)\n"
        f"time.sleep({seconds})\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_verify_and_status_wait_for_a_write_under_way(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    # a journalled write half done: the manifest says a transaction is under way
    manifest_path = tree / STATE / "manifest.json"
    holder = _hold_lock(tree, 30)
    try:
        for command in ("status", "verify"):
            waited = cli(command, "--site-packages", tree, "--lock-timeout", "0.3")
            assert waited.code == 2 and "held by pid" in waited.stderr, waited.stderr
            assert "drifted" not in waited.stdout and "modified" not in waited.stdout
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(manifest_path.read_text())["transaction"] is None
    assert cli("verify", "--site-packages", tree, "--lock-timeout", "5").code == 0


def test_verify_waits_then_judges_once_the_writer_is_done(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / STATE / "manifest.json").write_text(
        json.dumps({**json.loads((tree / STATE / "manifest.json").read_text()), "patch_digest": "other"})
    )  # off the fast path: the full judgement is what waits
    holder = _hold_lock(tree, 1.0)
    started = time.monotonic()
    result = cli("verify", "--site-packages", tree, "--lock-timeout", "20")
    holder.wait()
    assert result.code == 0 and time.monotonic() - started >= 0.5, result.stderr


def test_the_guard_reports_a_write_under_way_and_never_waits(make_tree, monkeypatch, caplog):
    tree = make_tree("0.30.0")
    module = types.ModuleType("vllm")
    module.__file__ = str(tree / "vllm" / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", module)
    holder = _hold_lock(tree, 30)
    try:
        monkeypatch.setattr(guard, "_reported", False)
        monkeypatch.setenv(guard.ENV, "warn")
        started = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
            guard.check()
        assert time.monotonic() - started < 2
        (record,) = [r for r in caplog.records if r.name == "vllm.patch_dsv4"]
        assert record.levelno == logging.ERROR and "writing this vLLM's files now" in record.getMessage()
        assert "pid" in record.getMessage()
        monkeypatch.setenv(guard.ENV, "strict")
        with pytest.raises(guard.PatchesNotInPlace):
            guard.check()
    finally:
        holder.kill()
        holder.wait()
