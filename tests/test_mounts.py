"""Files another tool owns are named up front: a file bind-mounted over site-packages (a V4.1 kit's overlay) is
marked by status, refused by apply, takeover and revert in the plan (exit 1, nothing written), and reported by
verify and the guard.

The mount table is read from ``patch_dsv4.tree.mounts.MOUNTINFO``: the tests point it at a fixture file that lists a
file of a real release tree as a mount point, so they need no mount; one test makes a real bind mount, and skips
alone where this machine does not let it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.tree import mounts
from tests.conftest import ROOT
from tests.releases import content_snapshot

OVERLAY = "another tool's overlay; patch the image it comes from"
# A mount table as /proc/self/mountinfo writes it: optional fields (shared:N) before the "-", escapes in paths.
TABLE = (
    "22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n"
    "23 22 0:22 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "not a mountinfo line\n"
    "45 22 254:0 {root} {point} rw,relatime shared:7 master:3 - ext4 /dev/vda rw,discard\n"
)


def _escaped(path: str) -> str:
    """A path as mountinfo writes it: space, tab, newline and backslash as octal escapes."""
    return "".join(f"\\{ord(ch):03o}" if ch in " \t\n\\" else ch for ch in path)


@pytest.fixture
def mounted_over(tmp_path, monkeypatch):
    """``mounted_over(file, root)``: the mount table says ``root`` (another filesystem's file) is bind-mounted
    over ``file``."""

    def mount(file, root: str) -> None:
        table = tmp_path / "mountinfo"
        table.write_text(TABLE.format(root=_escaped(root), point=_escaped(os.path.realpath(file))))
        monkeypatch.setattr(mounts, "MOUNTINFO", str(table))

    return mount


def test_the_mount_table_is_parsed_with_its_escapes():
    text = TABLE.format(root=_escaped("/kit dir/back\\slash.py"), point=_escaped("/site packages/vllm/x.py"))
    parsed = [(m.mount_point, m.root, m.fstype, m.source) for m in mounts.parse(text.encode())]
    assert parsed == [
        ("/", "/", "overlay", "overlay"),
        ("/proc", "/", "proc", "proc"),
        ("/site packages/vllm/x.py", "/kit dir/back\\slash.py", "ext4", "/dev/vda"),
    ]
    assert mounts.parse(b"") == [] and mounts.parse(b"1 2 3 4 5 6 7\n") == []  # no "-": not a mount line
    assert mounts.unescape(b"/a\\040b\\011c\\134d\\012") == "/a b\tc\\d\n"
    assert mounts.unescape(b"/odd\\08x") == "/odd\\08x"  # not an octal escape: kept as written


def test_status_names_the_mounted_file_and_apply_refuses_it_writing_nothing(make_tree, cli, mounted_over):
    tree = make_tree("0.30.0")
    mounted_over(tree / VL_MODEL, "/opt/kit overlay/vl_model.py")
    reason = f"bind-mounted over site-packages from /opt/kit overlay/vl_model.py: {OVERLAY}"
    status = cli("status", "--site-packages", tree)
    assert status.code == 0
    assert f"{VL_MODEL}: {reason}" in " ".join(status.stdout.split())  # a note, wrapped at 80 columns
    assert cli("status", "--site-packages", tree, "--json").json()["notes"] == [f"{VL_MODEL}: {reason}"]

    before = content_snapshot(tree)
    for command in (["apply"], ["apply", "--force"], ["takeover"], ["apply", "--dry-run"]):
        refused = cli(*command, "--site-packages", tree)
        assert refused.code == 1, (command, refused.stderr)
        assert refused.stderr.splitlines()[0] == f"patch-dsv4: error: cannot patch {VL_MODEL}: {reason}", command
        assert content_snapshot(tree) == before and not (tree / ".patch-dsv4").exists(), command
    document = cli("apply", "--site-packages", tree, "--json").json()
    assert document["exit_code"] == 1 and document["error"] == f"cannot patch {VL_MODEL}: {reason}"
    # another file of the plan, not mounted, is no reason to refuse: only stream-load's V4 file is named
    assert cli("apply", "--site-packages", tree, "--only", "wide-swa").code == 0


def test_revert_refuses_a_patched_file_mounted_over_and_verify_reports_it(make_tree, cli, mounted_over):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    mounted_over(tree / VL_MODEL, "/kit/vl_model.py")
    verify = cli("verify", "--site-packages", tree)  # our bytes are there: verify passes, and names the mount
    assert verify.code == 0
    assert f"{VL_MODEL}: bind-mounted over site-packages from /kit/vl_model.py: {OVERLAY}" in " ".join(
        verify.stdout.split()
    )
    before = content_snapshot(tree)
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1
    assert refused.stderr.splitlines()[0] == (
        f"patch-dsv4: error: cannot revert {VL_MODEL}: bind-mounted over site-packages from /kit/vl_model.py: {OVERLAY}"
    )
    assert content_snapshot(tree) == before and (tree / ".patch-dsv4" / "manifest.json").exists()


def test_the_guard_says_apply_cannot_write_the_mounted_file(make_tree, running, monkeypatch, mounted_over):
    tree = make_tree("0.30.0")
    mounted_over(tree / VL_MODEL, "/kit/vl_model.py")
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace) as raised:
        guard.check()
    message = str(raised.value)
    assert "stream-load is pending" in message
    assert f"apply cannot write {VL_MODEL}: bind-mounted over site-packages from /kit/vl_model.py" in message


def test_a_tree_without_mounts_reads_none(make_tree, cli, monkeypatch, tmp_path):
    tree = make_tree("0.30.0")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(tmp_path / "absent"))  # no table (no /proc): nothing is mounted
    assert mounts.unreplaceable(str(tree), [VL_MODEL]) == {}
    assert cli("status", "--site-packages", tree, "--json").json()["notes"] == []


def test_a_real_bind_mount_is_refused_before_anything_is_written(make_tree, tmp_path):
    """The real thing: ``mount --bind`` of a kit's file over the tree's vl_model.py (root only; skips elsewhere)."""
    tree = make_tree("0.30.0")
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "vl_model.py").write_bytes((tree / VL_MODEL).read_bytes())
    try:
        made = subprocess.run(["mount", "--bind", str(kit / "vl_model.py"), str(tree / VL_MODEL)], capture_output=True)
    except OSError:
        pytest.skip("no mount command here")
    if made.returncode != 0:
        pytest.skip(f"mounting is not permitted here: {made.stderr.decode().strip()}")
    try:
        before = content_snapshot(tree)
        run = subprocess.run(
            [sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert run.returncode == 1, run.stderr
        # longer than one log line (200 characters): what, then why, each on a line of its own
        assert run.stderr.splitlines() == [
            f"patch-dsv4: error: cannot patch {VL_MODEL}",
            f"patch-dsv4: why: bind-mounted over site-packages from {os.path.realpath(kit / 'vl_model.py')}: {OVERLAY}",
        ]
        assert content_snapshot(tree) == before and not (tree / ".patch-dsv4").exists()
    finally:
        subprocess.run(["umount", str(tree / VL_MODEL)], check=True)


def test_the_readme_shows_the_refusal_as_apply_prints_it(make_tree, cli, mounted_over):
    tree = make_tree("0.30.0")
    mounted_over(tree / VL_MODEL, "/opt/kit/vl_model.py")
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    shown = readme[readme.index("      $ patch-dsv4 apply") + 1].strip()
    assert cli("apply", "--site-packages", tree).stderr.splitlines() == [shown]
