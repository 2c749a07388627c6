"""Crash safety: a command killed with SIGKILL at every write step leaves the old tree or the new one."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.releases import DSV4, content_snapshot


# -- crash safety: SIGKILL at every write step -------------------------------------
def _killed_run(step: int, *args) -> int:
    """The command, in a child process killed with SIGKILL at its ``step``-th write step (the fault hook); the
    child's exit status, negative for a signal. The child is forked from this process (no interpreter start,
    the trees already parsed), so that every step can be tried; it writes nothing to this process's output."""
    from patch_dsv4.cli import main
    from patch_dsv4.tree import fs

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child exits without closing
            count = 0

            def hook(_name: str) -> None:
                nonlocal count
                count += 1
                if count == step:
                    os.kill(os.getpid(), signal.SIGKILL)

            fs.set_fault_hook(hook)
            code = main([str(a) for a in args])
        finally:
            os._exit(code if isinstance(code, int) else 70)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _old_or_new(tree: Path, old: dict, new: dict) -> None:
    # A killed writer may leave its hidden temp file beside a target; the next run removes it.
    now = {k: v for k, v in content_snapshot(tree).items() if not k.endswith(".tmp")}
    assert set(now) == set(old)
    for relpath, sha in now.items():
        assert sha in (old[relpath], new[relpath]), f"{relpath} is neither the old nor the new file"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.30.0"])
def test_apply_killed_at_every_step(version, make_tree, cli):
    reference = make_tree(version)
    old = content_snapshot(reference)
    assert cli("apply", "--site-packages", reference).code == 0
    new = content_snapshot(reference)
    assert old != new
    tree = make_tree(version)  # one tree throughout: each step must leave it as it began (asserted below)
    step = 0
    while True:
        step += 1
        recovery = "apply" if step % 2 else "revert"  # both kinds of recovery, across the steps
        code = _killed_run(step, "apply", "--site-packages", tree)
        if code == 0:
            assert content_snapshot(tree) == new
            break
        assert code == -9, f"step {step}: exit {code}"
        _old_or_new(tree, old, new)
        assert cli(recovery, "--site-packages", tree).code == 0, (step, recovery)
        assert content_snapshot(tree) == (new if recovery == "apply" else old), (step, recovery)
        assert not list((tree / DSV4).rglob("*.tmp"))
        if recovery == "apply":
            assert cli("verify", "--site-packages", tree).code == 0
            assert cli("revert", "--site-packages", tree).code == 0
            assert content_snapshot(tree) == old
        assert not (tree / ".patch-dsv4").exists(), (step, recovery)
        assert content_snapshot(tree) == old, (step, recovery)
    assert step > 5, "the fault hook never fired: nothing was tested"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.30.0"])
def test_revert_killed_at_every_step(version, make_tree, cli):
    tree = make_tree(version)  # one tree throughout: each step must leave it as it began (asserted below)
    old = content_snapshot(tree)
    step = 0
    while True:
        step += 1
        assert cli("apply", "--site-packages", tree).code == 0
        new = content_snapshot(tree)
        code = _killed_run(step, "revert", "--site-packages", tree)
        if code == 0:
            assert content_snapshot(tree) == old
            break
        assert code == -9, f"step {step}: exit {code}"
        _old_or_new(tree, old, new)
        assert cli("revert", "--site-packages", tree).code == 0, step
        assert content_snapshot(tree) == old
        assert not (tree / ".patch-dsv4").exists()
        assert not list((tree / DSV4).rglob("*.tmp"))
    assert step > 2, "the fault hook never fired: nothing was tested"
