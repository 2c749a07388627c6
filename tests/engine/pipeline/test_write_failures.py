"""All or none, also when a write fails: a failure injected at every write step, and real obstacles.

The fault seam (:func:`patch_dsv4.tree.fs.inject_faults`) raises an OSError at the n-th
write step of one apply or revert, for every n until the command runs through.
Each run must end with exit 2, one line on stderr and the tree exactly as it
began (files, state, no temp file, no lock) -- or, when the failure hits the
clean-up after the change is complete, with the change complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from patch_dsv4.patches.wide_swa import FLASHINFER_SPARSE
from patch_dsv4.tree.fs import inject_faults
from tests.conftest import ROOT, run_cli
from tests.errors import error_lines
from tests.releases import DSV4, content_snapshot

ERRORS = (errno.ENOSPC, errno.EIO, errno.EROFS)


def _state(tree: Path) -> dict[str, str]:
    state = tree / ".patch-dsv4"
    return {
        str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(state.rglob("*"))
        if p.is_file()
    }


def _leftovers(tree: Path) -> list[str]:
    found = [str(p) for p in (tree / DSV4).rglob("*.tmp")]
    if (tree / ".patch-dsv4.lock").exists():
        found.append(".patch-dsv4.lock")
    return found


def _run_with_fault(n: int, error: int, *args) -> tuple[object, int]:
    """Run the CLI with the n-th write step failing with ``error``; (result, write steps seen)."""
    seen = 0

    def hook(step: str) -> None:
        nonlocal seen
        if ":" not in step:  # a named point of the transaction, not a write
            return
        seen += 1
        if seen == n:
            raise OSError(error, os.strerror(error))

    with inject_faults(hook):
        result = run_cli(*args)
    return result, seen


def _one_line(result) -> str:
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "version,files",
    [("0.30.0", 2), ("0.28.0", 4)],
    ids=["two-files", "four-files"],
)
def test_apply_fails_at_every_write_step(version, files, make_tree):
    """One tree throughout: every failed run must leave it as it began, so the next run starts from there."""
    tree = make_tree(version)
    original = content_snapshot(tree)
    assert run_cli("apply", "--site-packages", tree).code == 0
    patched = content_snapshot(tree)
    assert run_cli("revert", "--site-packages", tree).code == 0
    assert sum(original[f] != patched[f] for f in original) == files
    failed = complete = 0
    n = 0
    while True:
        n += 1
        error = ERRORS[n % len(ERRORS)]
        result, seen = _run_with_fault(n, error, "apply", "--site-packages", tree)
        if seen < n:  # the fault never fired: every write step has been tried
            assert result.code == 0 and content_snapshot(tree) == patched
            break
        if result.code == 0:  # the failure hit the clean-up after the change was complete
            complete += 1
            assert content_snapshot(tree) == patched, n
            assert run_cli("verify", "--site-packages", tree).code == 0
            assert run_cli("revert", "--site-packages", tree).code == 0
        else:
            failed += 1
            assert result.code == 2, (n, result.stderr)
            assert os.strerror(error) in _one_line(result), (n, result.stderr)
            assert not (tree / ".patch-dsv4").exists(), (n, _state(tree))
        assert content_snapshot(tree) == original, f"write step {n}: the tree is not as it began"
        assert not _leftovers(tree), (n, _leftovers(tree))
    assert failed > 10 * files, f"only {failed} write steps failed the apply: the seam is not reached"
    print(f"{version}: {n - 1} write steps, {failed} undone, {complete} after completion")


@pytest.mark.slow
def test_apply_over_an_earlier_apply_fails_at_every_write_step(make_tree):
    """The state already holds one patch: a failed apply of the next one restores that state exactly."""
    tree = make_tree("0.30.0")
    assert run_cli("apply", "--site-packages", tree, "--only", "stream-load").code == 0
    files, state = content_snapshot(tree), _state(tree)
    n = 0
    while True:
        n += 1
        result, seen = _run_with_fault(n, errno.ENOSPC, "apply", "--site-packages", tree)
        if seen < n:
            assert result.code == 0
            break
        if result.code == 0:
            assert run_cli("revert", "--site-packages", tree).code == 0
            assert run_cli("apply", "--site-packages", tree, "--only", "stream-load").code == 0
        else:
            assert result.code == 2 and _one_line(result)
        assert content_snapshot(tree) == files, n
        assert _state(tree) == state, n
        assert not _leftovers(tree)
    assert n > 20
    print(f"apply over an earlier apply: {n - 1} write steps")


@pytest.mark.slow
def test_revert_fails_at_every_write_step(make_tree):
    tree = make_tree("0.30.0")
    original = content_snapshot(tree)
    assert run_cli("apply", "--site-packages", tree).code == 0
    patched, state = content_snapshot(tree), _state(tree)
    n = 0
    while True:
        n += 1
        result, seen = _run_with_fault(n, errno.EIO, "revert", "--site-packages", tree)
        if seen < n:
            assert result.code == 0 and content_snapshot(tree) == original
            break
        if result.code == 0:
            assert content_snapshot(tree) == original
        elif content_snapshot(tree) == original:
            # every file is back and the manifest is gone; only removing the rest of the state failed
            assert result.code == 2 and "reverted" in _one_line(result)
            assert run_cli("revert", "--site-packages", tree).code == 0
            assert not (tree / ".patch-dsv4").exists()
        else:
            assert result.code == 2 and _one_line(result)
            assert content_snapshot(tree) == patched, f"write step {n}: the tree is not as it began"
            assert _state(tree) == state, n
            assert run_cli("verify", "--site-packages", tree).code == 0
        if content_snapshot(tree) == original:
            assert run_cli("apply", "--site-packages", tree).code == 0
        assert content_snapshot(tree) == patched and _state(tree) == state
        assert not _leftovers(tree)
    assert n > 10
    print(f"revert: {n - 1} write steps")


# -- real obstacles (root, mounts, attributes) --------------------------------------------
def _root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root")


def _unchanged(tree: Path, original: dict, result) -> None:
    assert result.code == 2, (result.stdout, result.stderr)
    assert content_snapshot(tree) == original
    assert not (tree / ".patch-dsv4").exists()
    assert not _leftovers(tree)


def test_immutable_target_is_refused_before_anything_changes(make_tree):
    _root_only()
    tree = make_tree("0.30.0")
    target = tree / FLASHINFER_SPARSE  # the second file written
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        original = content_snapshot(tree)
        result = run_cli("apply", "--site-packages", tree)
        _unchanged(tree, original, result)
        line = _one_line(result)  # the cause, and what removes it (then the same command)
        assert f"{FLASHINFER_SPARSE}: Operation not permitted: the file is immutable (chattr +i; lsattr" in line
        assert line.endswith(f"(next: chattr -i {target} && patch-dsv4 apply --site-packages {tree})")
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_read_only_mount_is_refused_before_anything_changes(make_tree):
    """site-packages' own file system read-only (a mount of another one below it is another tool's: test_mounts)."""
    _root_only()
    tree = make_tree("0.30.0")
    if not _mount("--bind", str(tree), str(tree)):
        pytest.skip("bind mounts are not allowed here")
    try:
        assert _mount("-o", "remount,bind,ro", str(tree))
        original = content_snapshot(tree)
        result = run_cli("apply", "--site-packages", tree)
        _unchanged(tree, original, result)
        assert "Read-only file system" in _one_line(result)
    finally:
        subprocess.run(["umount", str(tree)], check=True)


def test_full_disk_is_refused_before_anything_changes(make_tree):
    """site-packages' own file system full (a tmpfs of its own, with the tree copied in)."""
    _root_only()
    tree = make_tree("0.30.0")
    saved = Path(tempfile.mkdtemp()) / "site-packages"
    shutil.copytree(tree, saved, symlinks=True)
    used = sum(p.lstat().st_size for p in saved.rglob("*") if not p.is_symlink() and p.is_file())
    if not _mount("-t", "tmpfs", "-o", f"size={used + (used >> 2) + (16 << 20)}", "tmpfs", str(tree)):
        pytest.skip("tmpfs mounts are not allowed here")
    try:
        shutil.copytree(saved, tree, symlinks=True, dirs_exist_ok=True)
        free = shutil.disk_usage(tree).free
        with open(tree / "filler", "wb") as fh:  # leave less room than the patched file needs
            fh.write(b"\0" * max(0, free - 8192))
        original = content_snapshot(tree)
        result = run_cli("apply", "--site-packages", tree)
        assert result.code == 2, result.stderr
        assert "No space left on device" in _one_line(result)
        assert content_snapshot(tree) == original
        assert not (tree / ".patch-dsv4").exists() and not _leftovers(tree)
    finally:
        subprocess.run(["umount", str(tree)], check=True)
        shutil.rmtree(saved.parent)


def test_root_owned_package_for_a_user_is_refused_before_anything_changes():
    """The user owns the site directory (state and lock can be made) but not vllm/."""
    _root_only()
    from tests.releases import minimal_tree

    uid = 54321
    base = Path(tempfile.mkdtemp(prefix="patch-dsv4-user-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        tree = minimal_tree("0.30.0", base / "site-packages")
        os.chown(tree, uid, uid)
        original = content_snapshot(tree)
        result = subprocess.run(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                sys.executable,
                "-m",
                "patch_dsv4",
                "apply",
                "--site-packages",
                str(tree),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and len(error_lines(result.stderr)) == 1, result.stderr
        said = error_lines(result.stderr)[0]  # who may not write what, and who may
        assert f"uid {uid} may not write {tree}/vllm/models/deepseek_v4/" in said and "(owner root, mode " in said
        assert said.endswith(f"(next: patch-dsv4 apply --site-packages {tree}, as root)")
        assert content_snapshot(tree) == original
        assert not (tree / ".patch-dsv4").exists() and not (tree / ".patch-dsv4.lock").exists()
    finally:
        shutil.rmtree(base)
