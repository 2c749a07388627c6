"""Files another tool owns are named up front: a file bind-mounted over site-packages (a V4.1 kit's overlay) is
marked by status, refused by apply, takeover and revert in the plan (exit 1, nothing written), and reported by
verify and the guard.

The mount table is read from ``patch_dsv4.tree.installed.MOUNTINFO``: the tests point it at a fixture file that lists a
file of a real release tree as a mount point, so they need no mount; one test makes a real bind mount, and skips
alone where this machine does not let it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.tree import installed, mounts
from tests.conftest import ROOT
from tests.errors import error_lines
from tests.releases import content_snapshot, wheel_file

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
        monkeypatch.setattr(installed, "MOUNTINFO", str(table))

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
        assert error_lines(refused.stderr)[0] == f"patch-dsv4: error: cannot patch {VL_MODEL}: {reason}", command
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
    assert error_lines(refused.stderr)[0] == (
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
    monkeypatch.setattr(installed, "MOUNTINFO", str(tmp_path / "absent"))  # no table (no /proc): nothing is mounted
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
        # what, then why, each on lines of its own within 80 columns (a path longer than a line stands whole)
        source = os.path.realpath(kit / "vl_model.py")
        assert error_lines(run.stderr) == [
            f"patch-dsv4: error: cannot patch {VL_MODEL}: bind-mounted over site-packages from {source}: {OVERLAY}"
        ]
        assert run.stderr.splitlines()[0] == f"patch-dsv4: error: cannot patch {VL_MODEL}"
        assert content_snapshot(tree) == before and not (tree / ".patch-dsv4").exists()
    finally:
        subprocess.run(["umount", str(tree / VL_MODEL)], check=True)


def test_the_readme_shows_the_refusal_as_apply_prints_it(make_tree, cli, mounted_over):
    tree = make_tree("0.30.0")
    mounted_over(tree / VL_MODEL, "/opt/kit/vl_model.py")
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index("      $ patch-dsv4 apply") + 1
    shown = [line.strip() for line in readme[start : start + 4] if line.strip().startswith("patch-dsv4:")]
    assert cli("apply", "--site-packages", tree).stderr.splitlines() == shown


# -- a directory above a file, any kind of mount, the whole table ---------------------------------------------------
COMMON = "vllm/models/deepseek_v4/common"


def test_a_directory_mounted_over_site_packages_is_named_and_refused(make_tree, cli, tmp_path, monkeypatch):
    """A kit's directory bind-mounted over vllm/models/deepseek_v4/common: every file we would write below it is
    another tool's. status names it, apply refuses before writing (and revert, after an apply made before the
    mount), with the mount's source."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    table = tmp_path / "mountinfo"
    table.write_text(TABLE.format(root="/kits/dsv4/common", point=_escaped(os.path.realpath(tree / COMMON))))
    monkeypatch.setattr(installed, "MOUNTINFO", str(table))
    reason = f"{COMMON}/ is mounted over site-packages (ext4 from /kits/dsv4/common): {OVERLAY}"
    status = cli("status", "--site-packages", tree, "--json").json()
    assert f"{VL_MODEL}: {reason}" in status["notes"]
    before = content_snapshot(tree)
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1 and refused.stderr.splitlines()[0] == f"patch-dsv4: error: cannot revert {VL_MODEL}"
    assert error_lines(refused.stderr) == [f"patch-dsv4: error: cannot revert {VL_MODEL}: {reason}"]
    assert content_snapshot(tree) == before
    verify = cli("verify", "--site-packages", tree, "--json").json()  # our bytes are there; the mount is named
    assert verify["exit_code"] == 0 and f"{VL_MODEL}: {reason}" in verify["notes"]


def test_revert_refuses_while_a_mount_shows_pip_bytes_over_a_file_it_patched(make_tree, cli, tmp_path, monkeypatch):
    """Applied, then a kit's directory mounted over common/ showing pip's bytes: our edit lies hidden below it.
    revert writes nothing there, but it must not remove the state either (its backup is what undoes the hidden
    edit once the mount is gone): refused, naming the mount, the state kept."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / VL_MODEL).write_bytes(wheel_file("0.30.0", VL_MODEL))  # what the mount shows
    table = tmp_path / "mountinfo"
    table.write_text(TABLE.format(root="/kits/dsv4/common", point=_escaped(os.path.realpath(tree / COMMON))))
    monkeypatch.setattr(installed, "MOUNTINFO", str(table))
    before = content_snapshot(tree)
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1, refused.stdout
    reason = f"{COMMON}/ is mounted over site-packages (ext4 from /kits/dsv4/common): {OVERLAY}"
    assert error_lines(refused.stderr)[0].startswith(f"patch-dsv4: error: cannot revert {VL_MODEL}"), refused.stderr
    assert reason in " ".join(error_lines(refused.stderr))
    assert content_snapshot(tree) == before and (tree / ".patch-dsv4" / "manifest.json").exists()


def test_a_mount_a_later_mount_above_it_hides_is_not_one_we_write_into(make_tree, cli, tmp_path, monkeypatch):
    """Mounted over common/ first, then site-packages itself mounted again (a new image layer): the first mount
    is hidden, the files are on site-packages' own mount, nothing is named."""
    tree = make_tree("0.30.0")
    site = os.path.realpath(tree)
    table = tmp_path / "mountinfo"
    table.write_text(
        TABLE.format(root="/kits/dsv4/common", point=_escaped(os.path.realpath(tree / COMMON)))
        + f"46 22 254:0 /images/site {_escaped(site)} rw,relatime - ext4 /dev/vda rw\n"
    )
    monkeypatch.setattr(installed, "MOUNTINFO", str(table))
    found = mounts.mount_of(os.path.realpath(tree / VL_MODEL), mounts.read_mounts())
    assert (found.mount_id, found.mount_point) == (46, site)
    assert cli("status", "--site-packages", tree, "--json").json()["notes"] == []


def test_the_whole_mount_table_is_read_however_long(make_tree, cli, tmp_path, monkeypatch):
    """A table of 12 MiB (60,000 mounts elsewhere) with the kit's mount last: read to its end, the mount named."""
    tree = make_tree("0.30.0")
    filler = "".join(
        f"{100 + n} 22 0:{n} / /srv/volume-{n:06d} rw - tmpfs tmpfs rw,size={'x' * 160}\n" for n in range(60_000)
    )
    table = tmp_path / "mountinfo"
    table.write_text(TABLE.format(root="/kit/vl_model.py", point=_escaped(os.path.realpath(tree / "x"))) + filler)
    with open(table, "a") as fh:
        fh.write(
            f"99999 22 254:0 /kit/vl_model.py {_escaped(os.path.realpath(tree / VL_MODEL))} rw - ext4 /dev/vda rw\n"
        )
    assert table.stat().st_size > 12 << 20
    monkeypatch.setattr(installed, "MOUNTINFO", str(table))
    notes = cli("status", "--site-packages", tree, "--json").json()["notes"]
    assert notes == [f"{VL_MODEL}: bind-mounted over site-packages from /kit/vl_model.py: {OVERLAY}"]


def _in_a_mount_namespace(script: str, tree, tmp_path) -> subprocess.CompletedProcess:
    """``script`` (sh) in a mount namespace of its own (``unshare -m``): its mounts vanish with it. ``$PD`` runs
    patch-dsv4 from this checkout, ``$T`` is the tree. Skips where this machine does not allow it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mount namespaces need root and unshare(1)")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not allowed here: {probe.stderr.strip()}")
    env = {**os.environ, "PD": f"{sys.executable} -m patch_dsv4", "T": str(tree), "K": str(tmp_path)}
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("kind", ["tmpfs", "bind", "overlay"])
def test_a_real_mount_over_a_directory_is_refused_before_anything_is_written(kind, make_tree, tmp_path):
    """The real thing, in a mount namespace: a tmpfs, a bind mount or an overlay over common/, holding a copy of its
    files. status names it with the mount's source; apply refuses, writing nothing there or in the tree."""
    import shutil as sh

    tree = make_tree("0.30.0")
    sh.copytree(tree / COMMON, tmp_path / "kit")
    mount = {
        "tmpfs": 'mount -t tmpfs kit-tmpfs "$T/' + COMMON + '" && cp -a "$K/kit/." "$T/' + COMMON + '/"',
        "bind": 'mount --bind "$K/kit" "$T/' + COMMON + '"',
        "overlay": 'mkdir -p "$K/up" "$K/work" && mount -t overlay kit-overlay -o lowerdir="$K/kit",upperdir="$K/up",'
        'workdir="$K/work" "$T/' + COMMON + '"',
    }[kind]
    script = (
        mount
        + ' && $PD status --site-packages "$T" --json > "$K/status.json"; $PD apply --site-packages "$T" 2> "$K/err";'
        ' echo $? > "$K/rc"; sha256sum "$T/' + COMMON + '/vl_model.py" > "$K/sum"'
    )
    before = content_snapshot(tree)
    ran = _in_a_mount_namespace(script, tree, tmp_path)
    if ran.returncode != 0 or not (tmp_path / "rc").exists():
        pytest.skip(f"a {kind} mount is not allowed here: {ran.stderr.strip()[-300:]}")
    origin = {"tmpfs": "kit-tmpfs", "bind": str(tmp_path / "kit"), "overlay": "kit-overlay"}[kind]
    status = json.loads((tmp_path / "status.json").read_text())
    (note,) = [n for n in status["notes"] if n.startswith(VL_MODEL)]
    assert f"{COMMON}/ is mounted over site-packages (" in note and origin in note, note
    assert (tmp_path / "rc").read_text().strip() == "1"
    assert (tmp_path / "err").read_text().splitlines()[0] == f"patch-dsv4: error: cannot patch {VL_MODEL}"
    pristine = (tmp_path / "kit" / "vl_model.py").read_bytes()
    assert (tmp_path / "sum").read_text().split()[0] == __import__("hashlib").sha256(pristine).hexdigest()
    assert content_snapshot(tree) == before and not (tree / ".patch-dsv4").exists()


def test_a_state_directory_mounted_from_elsewhere_is_refused(make_tree, tmp_path):
    tree = make_tree("0.30.0")
    (tmp_path / "elsewhere").mkdir()
    script = (
        'mkdir "$T/.patch-dsv4" && mount --bind "$K/elsewhere" "$T/.patch-dsv4"'
        ' && $PD apply --site-packages "$T" 2> "$K/err"; echo $? > "$K/rc"'
    )
    ran = _in_a_mount_namespace(script, tree, tmp_path)
    if ran.returncode != 0 or not (tmp_path / "rc").exists():
        pytest.skip(f"a bind mount is not allowed here: {ran.stderr.strip()[-300:]}")
    assert (tmp_path / "rc").read_text().strip() == "1"
    assert (tmp_path / "err").read_text().splitlines()[0].startswith("patch-dsv4: error: cannot patch .patch-dsv4")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_mount_inside_the_state_directory_is_refused(make_tree, tmp_path):
    """Applied, then another file system mounted over .patch-dsv4/backups (a copy of the backups on it): status names
    it; apply --with and revert refuse before writing, so no backup lands on it and none is removed from it (apply
    wrote three new backups there, and revert deleted them and failed with EBUSY)."""
    tree = make_tree("0.30.0")
    (tmp_path / "elsewhere").mkdir()
    script = (
        '$PD apply --site-packages "$T" -q && mount -t tmpfs other-fs "$K/elsewhere"'
        ' && cp -a "$T/.patch-dsv4/backups/." "$K/elsewhere/" && mount --bind "$K/elsewhere" "$T/.patch-dsv4/backups"'
        ' && find "$K/elsewhere" -type f | sort > "$K/before"'
        ' && $PD status --site-packages "$T" --json > "$K/status.json";'
        ' $PD apply --site-packages "$T" --with aux-streams 2> "$K/apply-err"; echo $? > "$K/apply-rc";'
        ' $PD revert --site-packages "$T" 2> "$K/revert-err"; echo $? > "$K/revert-rc";'
        ' find "$K/elsewhere" -type f | sort > "$K/after"'
    )
    ran = _in_a_mount_namespace(script, tree, tmp_path)
    if ran.returncode != 0 or not (tmp_path / "revert-rc").exists():
        pytest.skip(f"a tmpfs or bind mount is not allowed here: {ran.stderr.strip()[-300:]}")
    notes = json.loads((tmp_path / "status.json").read_text())["notes"]
    assert any(n.startswith(".patch-dsv4: .patch-dsv4/backups/ is mounted there (") for n in notes), notes
    for verb in ("apply", "revert"):
        assert (tmp_path / f"{verb}-rc").read_text().strip() == "1", (tmp_path / f"{verb}-err").read_text()
        said = " ".join(error_lines((tmp_path / f"{verb}-err").read_text()))
        assert ".patch-dsv4/backups/ is mounted there" in said and "other-fs" in said, said
    assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text() != ""
