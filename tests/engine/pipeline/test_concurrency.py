"""Concurrent writers and readers: ranks applying at once, readers while another process writes."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import DSV4, content_snapshot

STATE = ".patch-dsv4"
LOCK = ".patch-dsv4.lock"


def _rank(args, start, judged, fired, index, devnull):
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    import patch_dsv4.tree.fs
    from patch_dsv4.cli import main

    def overlap(step: str) -> None:
        # Make the ranks overlap for certain: each waits until all have judged
        # the tree (only possible when nothing serialises them; with the lock
        # the wait times out), then they reach the writes one after another.
        # Without the lock, late ranks find files that early ones patched after
        # they judged them, and this test fails (bench/lock_demo.py shows it).
        if step == "judged":
            with fired.get_lock():
                fired.value += 1
            try:
                judged.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass
            time.sleep(index * 0.1)

    patch_dsv4.tree.fs.set_fault_hook(overlap)
    start.wait()
    os._exit(main(args))


def run_ranks(tree: Path, n: int = 8) -> tuple[list[int], int]:
    """Exit codes of ``n`` ranks applying at once, and how many of them reached the overlap point."""
    ctx = multiprocessing.get_context("fork")
    start, judged, fired = ctx.Barrier(n), ctx.Barrier(n), ctx.Value("i", 0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    args = ["apply", "--site-packages", str(tree)]
    procs = [ctx.Process(target=_rank, args=(args, start, judged, fired, i, devnull)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    os.close(devnull)
    return [p.exitcode for p in procs], fired.value


@pytest.mark.slow
def test_eight_ranks_apply_at_once(make_tree, cli):
    tree = make_tree("0.30.0")
    original = content_snapshot(tree)
    codes, fired = run_ranks(tree)
    assert codes == [0] * 8
    assert fired == 8, "the overlap hook did not fire in every rank: nothing was tested"
    assert cli("verify", "--site-packages", tree).code == 0
    status = cli("status", "--site-packages", tree, "--json").json()
    assert status["state"] == "current"
    patched = sorted(f for p in status["patches"] if p["verdict"] == "applied" for f in p["files"])
    assert VL_MODEL in patched
    backups = sorted(
        str(p.relative_to(tree / ".patch-dsv4" / "backups"))
        for p in (tree / ".patch-dsv4" / "backups").rglob("*")
        if p.is_file()
    )
    assert backups == patched  # one backup set
    assert not list((tree / ".patch-dsv4").rglob("*.tmp"))
    assert not list((tree / DSV4).rglob("*.tmp"))
    assert cli("revert", "--site-packages", tree).code == 0
    assert content_snapshot(tree) == original
    assert not (tree / ".patch-dsv4.lock").exists()


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
