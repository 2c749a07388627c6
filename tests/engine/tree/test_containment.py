"""Nothing outside the environment: paths from the state, links in the tree, temp files, the lock.

Each case runs every command against a tree whose state or layout was forged
the way a hostile user of a shared environment could, and asserts one line on
stderr, exit 2, nothing written or deleted in the tree, and nothing outside it
touched (a sentinel directory beside the tree stays as it was).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.patches.wide_swa import FLASHINFER_SPARSE
from tests.conftest import ROOT
from tests.errors import error_lines
from tests.errors import exit_2_line as _error
from tests.releases import content_snapshot, stat_snapshot, wheel_file

COMMANDS = ("status", "verify", "apply", "revert")
MANIFEST = Path(".patch-dsv4") / "manifest.json"


def _one_line(result) -> str:
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _snapshot(*dirs: Path) -> dict:
    snap = {}
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = [s for s in subdirs if s != "__pycache__"]
            for name in [*files, *subdirs]:
                p = Path(root) / name
                st = p.lstat()
                snap[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid)
    return snap


@pytest.fixture
def applied(make_tree, cli, tmp_path):
    """A 0.30.0 tree with stream-load and wide-swa applied, and a sentinel directory outside it."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.py").write_text("# must never change\n")
    return tree, outside


def _forge(tree: Path, change) -> None:
    path = tree / MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _all_refused(cli, tree: Path, outside: Path, words=("unreadable state",)) -> None:
    before = _snapshot(tree, outside)
    for command in COMMANDS:
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, (command, result.stdout, result.stderr)
        line = _one_line(result)
        for word in words:
            assert word in line, (command, line)
    assert _snapshot(tree, outside) == before


def _move_key(data: dict, old: str, new: str) -> None:
    data["files"][new] = data["files"].pop(old)


@pytest.mark.parametrize(
    "forged",
    [
        "../../outside/victim.py",
        "/etc/passwd",
        "vllm/models/../../../outside/victim.py",
        "vllm//models/deepseek_v4/common/vl_model.py",
        "vllm/models/deepseek_v4/common/vl_model.py\x00.bak",
        "",
        "vllm/models/deepseek_v4/nvidia/ops/o_proj.py",  # a real file, but no patch edits it
    ],
    ids=["dotdot", "absolute", "inner-dotdot", "empty-part", "nul", "empty", "undeclared"],
)
def test_manifest_file_outside_what_patches_edit(forged, applied, cli):
    tree, outside = applied
    _forge(tree, lambda d: _move_key(d, VL_MODEL, forged))
    _all_refused(cli, tree, outside)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(transaction={"op": "rm -rf", "files": {}}),
        lambda d: d.update(transaction={"op": "apply"}),
        lambda d: d.update(transaction={"op": "revert", "files": {VL_MODEL: {"from": "0" * 64}}}),
        lambda d: d.update(
            transaction={"op": "apply", "files": {"../../outside/victim.py": {"from": "0" * 64, "to": "1" * 64}}}
        ),
        lambda d: d.update(
            transaction={
                "op": "apply",
                "files": {"vllm/models/deepseek_v4/nvidia/model.py": {"from": "0" * 64, "to": "1" * 64}},
            }
        ),
        lambda d: d.update(transaction=["apply"]),
        lambda d: d["files"][VL_MODEL].update(before=12),
        lambda d: d["files"][VL_MODEL].update(patches="stream-load"),
        lambda d: d.update(files=[]),
        lambda d: d.update(inputs={"../../outside/victim.py": None}),
        lambda d: d.update(inputs={"/dev/zero": None}),
    ],
    ids=[
        "unknown-op",
        "no-files",
        "move-without-to",
        "journal-outside",
        "journal-not-in-manifest",
        "journal-not-object",
        "before-not-sha",
        "patches-not-list",
        "files-not-object",
        "input-outside",
        "input-device",
    ],
)
def test_malformed_journal_or_manifest(change, applied, cli):
    tree, outside = applied
    _forge(tree, change)
    _all_refused(cli, tree, outside)


@pytest.mark.parametrize(
    "text", ["[]", '"manifest"', "[" * 100_000 + "]" * 100_000, "{" + '"a":' * 50_000 + "1" + "}" * 50_000]
)
def test_manifest_not_an_object_or_nested_deep(text, applied, cli):
    tree, outside = applied
    (tree / MANIFEST).write_text(text)
    _all_refused(cli, tree, outside)


def test_fifo_in_the_state_never_hangs(applied, cli):
    """A FIFO named in the state (inside the tree, where the path rules allow it) is not read."""
    tree, outside = applied
    fifo = tree / "vllm" / "models" / "deepseek_v4" / "fifo.py"
    os.mkfifo(fifo)
    _forge(tree, lambda d: d["inputs"].update({"vllm/models/deepseek_v4/fifo.py": "0" * 64}))
    for command in ("status", "verify"):
        result = subprocess.run(
            [sys.executable, "-m", "patch_dsv4", command, "--site-packages", str(tree)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in result.stderr
        assert result.returncode in (0, 1), result.stderr


def test_state_directory_that_is_a_symlink(applied, cli):
    tree, outside = applied
    moved = outside / "state"
    shutil.move(str(tree / ".patch-dsv4"), moved)
    (tree / ".patch-dsv4").symlink_to(moved, target_is_directory=True)
    _all_refused(cli, tree, outside, ("unreadable state", "symbolic link"))


@pytest.mark.parametrize("part", ["backups", "backups/vllm/models"])
def test_state_part_that_is_a_symlink(part, applied, cli):
    tree, outside = applied
    real = tree / ".patch-dsv4" / part
    moved = outside / "moved"
    shutil.move(str(real), moved)
    real.symlink_to(moved, target_is_directory=True)
    before = _snapshot(tree, outside)
    result = cli("revert", "--site-packages", tree)
    assert result.code == 2, result.stderr
    assert "symbolic link" in _one_line(result)
    assert _snapshot(tree, outside) == before


def test_backup_that_is_a_symlink_is_never_restored(applied, cli):
    """Even a link to a file with exactly the recorded bytes: a backup is a regular file of ours."""
    tree, outside = applied
    backup = tree / ".patch-dsv4" / "backups" / VL_MODEL
    copy = outside / "copy.py"
    shutil.copy(backup, copy)
    backup.unlink()
    backup.symlink_to(copy)
    before = _snapshot(tree, outside)
    result = cli("revert", "--site-packages", tree)
    assert result.code == 2, result.stderr
    assert "symbolic link" in _one_line(result)
    assert _snapshot(tree, outside) == before


def test_backup_with_other_bytes_is_never_restored(applied, cli):
    tree, outside = applied
    backup = tree / ".patch-dsv4" / "backups" / VL_MODEL
    backup.write_text(backup.read_text() + "\n# not what was installed\n")
    before = _snapshot(tree, outside)
    result = cli("revert", "--site-packages", tree)
    assert result.code == 1, result.stderr
    assert "backup" in _one_line(result)
    assert _snapshot(tree, outside) == before


def test_lock_path_that_is_a_symlink(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    victim = tmp_path / "victim"
    (tree / ".patch-dsv4.lock").symlink_to(victim)
    before = stat_snapshot(tree)
    for command in ("apply", "revert"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, result.stderr
        assert "symbolic link" in _one_line(result)
    assert not victim.exists()
    assert stat_snapshot(tree) == before


def test_planted_temp_names_are_never_followed(make_tree, cli, tmp_path, monkeypatch):
    """The temp file's name is not predictable; even when it is guessed, a planted link is left alone."""
    import secrets

    tree = make_tree("0.30.0")
    victim = tmp_path / "victim"
    victim.write_text("# must never change\n")
    directory = (tree / VL_MODEL).parent
    guessed = "0" * 32
    planted = directory / f".vl_model.py.patch-dsv4-{guessed}.tmp"
    planted.symlink_to(victim)
    names = iter([guessed, guessed, *(secrets.token_hex(16) for _ in range(100))])
    monkeypatch.setattr(secrets, "token_hex", lambda n=16: next(names))
    assert cli("apply", "--site-packages", tree).code == 0
    assert victim.read_text() == "# must never change\n"
    assert planted.is_symlink()
    monkeypatch.undo()
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert planted.is_symlink() and victim.read_text() == "# must never change\n"


def test_linked_vllm_package_keeps_working(make_tree, cli, tmp_path):
    """site/vllm -> elsewhere/vllm is a layout people use: the package is where it links to."""
    tree = make_tree("0.30.0")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(str(tree / "vllm"), elsewhere / "vllm")
    (tree / "vllm").symlink_to(elsewhere / "vllm", target_is_directory=True)
    assert cli("apply", "--site-packages", tree).code == 0
    assert "_patch_dsv4_" in (elsewhere / VL_MODEL).read_text()
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert (elsewhere / VL_MODEL).read_bytes() == wheel_file("0.30.0", VL_MODEL)


def test_link_deeper_inside_that_leads_elsewhere_is_refused(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    common = (tree / VL_MODEL).parent
    elsewhere = tmp_path / "common"
    shutil.move(str(common), elsewhere)
    common.symlink_to(elsewhere, target_is_directory=True)
    before = _snapshot(tree, elsewhere)
    result = cli("apply", "--site-packages", tree)
    assert result.code == 2, result.stderr
    line = _one_line(result)
    assert "outside the vLLM package" in line and "common" in line
    assert _snapshot(tree, elsewhere) == before


def test_target_that_is_a_link_inside_the_package_is_replaced_not_written_through(make_tree, cli):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    real = target.with_name("vl_model_real.py")
    target.rename(real)
    target.symlink_to(real.name)
    original = real.read_bytes()
    assert cli("apply", "--site-packages", tree, "--only", "stream-load").code == 0
    assert not target.is_symlink() and "_patch_dsv4_" in target.read_text()
    assert real.read_bytes() == original
    assert cli("revert", "--site-packages", tree).code == 0
    assert target.read_bytes() == original and not target.is_symlink()


def test_target_that_links_out_of_the_package_is_refused(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    outside = tmp_path / "vl_model.py"
    shutil.copy(target, outside)
    target.unlink()
    target.symlink_to(outside)
    before = _snapshot(tree, tmp_path / "vl_model.py")
    result = cli("apply", "--site-packages", tree, "--only", "stream-load")
    assert result.code == 2, result.stderr
    assert "outside the vLLM package" in _one_line(result)
    assert _snapshot(tree, tmp_path / "vl_model.py") == before
    assert outside.read_bytes() == wheel_file("0.30.0", VL_MODEL)


# -- ownership and mode -------------------------------------------------------------------
OTHER_UID = 54321

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")


def _other_users_tree(version: str, base: Path) -> Path:
    """A tree another user owns, in a directory that user can reach and read in full."""
    from tests.releases import minimal_tree

    tree = minimal_tree(version, base / "site-packages")
    for root, dirs, files in os.walk(base):
        for name in [*dirs, *files]:
            os.chown(Path(root) / name, OTHER_UID, OTHER_UID, follow_symlinks=False)
    return tree


@needs_root
def test_root_apply_keeps_owner_group_and_mode_and_the_owner_can_revert(cli):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="patch-dsv4-owned-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        tree = _other_users_tree("0.30.0", base)
        for rel in (VL_MODEL, FLASHINFER_SPARSE):
            os.chmod(tree / rel, 0o640)
        original = content_snapshot(tree)
        assert cli("apply", "--site-packages", tree).code == 0
        for rel in (VL_MODEL, FLASHINFER_SPARSE):
            st = (tree / rel).stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OTHER_UID, OTHER_UID, 0o640), rel
        for root, dirs, files in os.walk(tree / ".patch-dsv4"):
            for name in [".", *dirs, *files]:
                st = (Path(root) / name).lstat()
                assert (st.st_uid, st.st_gid) == (OTHER_UID, OTHER_UID), Path(root) / name
        revert = subprocess.run(
            [
                "setpriv",
                f"--reuid={OTHER_UID}",
                f"--regid={OTHER_UID}",
                "--clear-groups",
                sys.executable,
                "-m",
                "patch_dsv4",
                "revert",
                "--site-packages",
                str(tree),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        assert revert.returncode == 0, revert.stderr
        assert content_snapshot(tree) == original
        assert not (tree / ".patch-dsv4").exists() and not (tree / ".patch-dsv4.lock").exists()
        for rel in (VL_MODEL, FLASHINFER_SPARSE):
            st = (tree / rel).stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (OTHER_UID, 0o640)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- odd targets ---------------------------------------------------------------------
@pytest.mark.parametrize("odd", ["directory", "link-loop"])
def test_target_that_is_a_directory_or_a_link_loop(odd, make_tree, cli):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    target.unlink()
    if odd == "directory":
        target.mkdir()
    else:
        loop = target.with_name("loop.py")
        loop.symlink_to(target.name)
        target.symlink_to(loop.name)
    before = stat_snapshot(tree)
    for command in ("status", "verify", "apply"):
        _error(cli(command, "--site-packages", tree), VL_MODEL)
    assert stat_snapshot(tree) == before
