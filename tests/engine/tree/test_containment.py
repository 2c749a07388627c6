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


def _patched_files(tree: Path) -> list[str]:
    """The files of ``tree``'s model packages that are not what pip installed (for the trees here: ours)."""
    from tests.releases import pristine_tree

    pristine = content_snapshot(pristine_tree("0.30.0"), "vllm/models")
    return sorted(rel for rel, sha in content_snapshot(tree, "vllm/models").items() if pristine.get(rel) != sha)


def _refused_then_rebuilt(cli, tree: Path, outside: Path) -> None:
    """A forged manifest: status and verify refuse it in one line (exit 2), writing nothing, and name apply; apply
    rebuilds the state from proof alone, never from what the manifest names: nothing outside is touched, the
    forged manifest is kept as it was, and the new state names only the files that carry our edits."""
    before, outside_before = _snapshot(tree, outside), _snapshot(outside)
    forged = (tree / MANIFEST).read_bytes()
    for command in ("status", "verify"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, (command, result.stdout, result.stderr)
        line = _one_line(result)
        assert "unreadable state" in line and f"(next: patch-dsv4 apply --site-packages {tree} (rebuilds" in line
    assert _snapshot(tree, outside) == before
    rebuilt = cli("apply", "--site-packages", tree)
    assert rebuilt.code == 0, rebuilt.stderr
    assert _snapshot(outside) == outside_before
    (kept,) = (tree / ".patch-dsv4" / "saved-edits").glob("*/manifest.json.unreadable")
    assert kept.read_bytes() == forged
    assert sorted(json.loads((tree / MANIFEST).read_text())["files"]) == _patched_files(tree)
    assert cli("verify", "--site-packages", tree).code == 0


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
    _refused_then_rebuilt(cli, tree, outside)


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
    _refused_then_rebuilt(cli, tree, outside)


@pytest.mark.parametrize(
    "text", ["[]", '"manifest"', "[" * 100_000 + "]" * 100_000, "{" + '"a":' * 50_000 + "1" + "}" * 50_000]
)
def test_manifest_not_an_object_or_nested_deep(text, applied, cli):
    tree, outside = applied
    (tree / MANIFEST).write_text(text)
    _refused_then_rebuilt(cli, tree, outside)


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


# -- a state without a manifest: rebuilt from what is inside the environment only ---------------------------------
def test_a_lost_state_never_takes_pip_bytes_through_a_linked_backup(applied, cli):
    """A link to a file holding exactly pip's bytes, where a backup would be: never read, and the state is not
    rebuilt on it (its file carries our edits)."""
    tree, outside = applied
    backup = tree / ".patch-dsv4" / "backups" / VL_MODEL
    shutil.copy(backup, outside / "copy.py")
    backup.unlink()
    backup.symlink_to(outside / "copy.py")
    (tree / MANIFEST).unlink()
    before = _snapshot(tree, outside)
    for command in ("apply", "revert"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, result.stderr
        line = _one_line(result)
        assert f"cannot rebuild the state {tree / '.patch-dsv4'}: it has no manifest, and {VL_MODEL}" in line
        assert "its backup in .patch-dsv4/backups/ is not a regular file" in line
    assert _snapshot(tree, outside) == before


@pytest.mark.parametrize("wheel_cached", [False, True], ids=["no-wheel", "wheel-cached"])
def test_a_lost_state_never_walks_a_linked_part_of_its_backups(wheel_cached, applied, cli, monkeypatch, tmp_path):
    """backups/vllm/models is a link to a directory elsewhere holding pip's bytes: never followed. Without the
    release's wheel nothing proves them (refused); with it, the state is rebuilt from the wheel and the link is
    set aside as it is (moved, not followed)."""
    from tests.releases import cache_dir, wheel

    monkeypatch.setenv("PATCH_DSV4_CACHE", str(cache_dir() if wheel_cached else tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    if wheel_cached:
        wheel("vllm", "0.30.0")
    tree, outside = applied
    part = tree / ".patch-dsv4" / "backups" / "vllm" / "models"
    shutil.move(str(part), outside / "models")
    part.symlink_to(outside / "models", target_is_directory=True)
    (tree / MANIFEST).unlink()
    before, outside_before = _snapshot(tree, outside), _snapshot(outside)
    result = cli("apply", "--site-packages", tree)
    assert _snapshot(outside) == outside_before
    if not wheel_cached:
        assert result.code == 2
        line = _one_line(result)
        assert f"{VL_MODEL} carries patch-dsv4's edits, but no backup holds pip's bytes: cannot fetch" in line
        assert _snapshot(tree, outside) == before
        return
    assert result.code == 0, result.stderr
    (aside,) = (tree / ".patch-dsv4" / "saved-edits").glob("*/backups/vllm/models")
    assert aside.is_symlink() and os.readlink(aside) == str(outside / "models")
    assert sorted(json.loads((tree / MANIFEST).read_text())["files"]) == _patched_files(tree)
    assert cli("revert", "--site-packages", tree).code == 0 and _patched_files(tree) == []
    assert _snapshot(outside) == outside_before


def test_a_lost_state_sets_aside_backups_of_files_no_patch_edits_or_not_in_record(applied, cli):
    """Backups of a real file no patch edits, of a file RECORD lists but no patch edits, of a file a patch edits
    that this release does not have, and a FIFO: none is read for the proof or restored, each set aside whole."""
    tree, outside = applied
    backups = tree / ".patch-dsv4" / "backups"
    odd = {
        "vllm/models/deepseek_v4/nvidia/ops/o_proj.py": b"# not pip's\n",
        "vllm/__init__.py": (tree / "vllm" / "__init__.py").read_bytes(),
        "vllm/models/deepseek_v4_1/nvidia/vl_model.py": b"# no such file in 0.30.0\n",
    }
    for relpath, data in odd.items():
        (backups / relpath).parent.mkdir(parents=True, exist_ok=True)
        (backups / relpath).write_bytes(data)
    os.mkfifo(backups / "vllm" / "fifo.py")
    (tree / MANIFEST).unlink()
    pristine_init = (tree / "vllm" / "__init__.py").read_bytes()
    applied_files = _patched_files(tree)
    result = cli("apply", "--site-packages", tree, "--json")
    assert result.code == 0, result.stderr
    assert "4 backup(s) that are not their file's bytes kept in .patch-dsv4/saved-edits/" in result.json()["notes"][0]
    assert sorted(json.loads((tree / MANIFEST).read_text())["files"]) == applied_files
    (run,) = (tree / ".patch-dsv4" / "saved-edits").iterdir()
    for relpath, data in odd.items():
        assert (run / "backups" / relpath).read_bytes() == data and not (backups / relpath).exists()
    assert stat.S_ISFIFO((run / "backups" / "vllm" / "fifo.py").lstat().st_mode)
    assert cli("revert", "--site-packages", tree).code == 0
    assert _patched_files(tree) == [] and (tree / "vllm" / "__init__.py").read_bytes() == pristine_init


def test_a_lost_state_walks_only_the_way_to_the_files_patches_edit(applied, cli):
    """Under backups/, a tree of directories deeper than Python recurses and wider than a process may hold open,
    where no patch edits a file: each top directory is one entry, moved aside whole, never walked."""
    tree, outside = applied
    backups = tree / ".patch-dsv4" / "backups"
    deep = backups / "vllm" / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(1500):  # made relative to each new directory: no path grows past PATH_MAX
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    wide = backups / "vllm" / "models" / "wide"
    for index in range(2000):
        (wide / str(index)).mkdir(parents=True)
    (tree / MANIFEST).unlink()
    outside_before = _snapshot(outside)
    try:
        result = cli("apply", "--site-packages", tree, "--json")
        assert result.code == 0, result.stderr
        note = result.json()["notes"][0]
        assert "2 backup(s) that are not their file's bytes kept in .patch-dsv4/saved-edits/" in note
        (run,) = (tree / ".patch-dsv4" / "saved-edits").iterdir()
        assert (run / "backups" / "vllm" / "deep" / "d" / "d").is_dir() and not deep.exists()
        assert len(list((run / "backups" / "vllm" / "models" / "wide").iterdir())) == 2000
        assert sorted(json.loads((tree / MANIFEST).read_text())["files"]) == _patched_files(tree)
        assert _snapshot(outside) == outside_before
        assert cli("verify", "--site-packages", tree).code == 0
    finally:  # shutil.rmtree recurses: the fixture could not remove it
        for top in (deep, *(tree / ".patch-dsv4" / "saved-edits").glob("*/backups/vllm/deep")):
            _remove_chain(top)


def _remove_chain(top: Path) -> None:
    """Remove a chain of directories named "d" below ``top``, one level a step (no recursion, short paths)."""
    while (top / "d").is_dir():
        if (top / "d" / "d").is_dir():
            os.rename(top / "d" / "d", top / "next")
            os.rmdir(top / "d")
            os.rename(top / "next", top / "d")
        else:
            os.rmdir(top / "d")


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
