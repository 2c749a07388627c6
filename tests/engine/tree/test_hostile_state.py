"""Hostile and unlucky input in each file patch-dsv4 reads of a tree: the state's manifest, its lock, an older
version's stat keys, its backups, and vLLM's dist-info. Each is one line naming the file (exit 2), or for the guard
one message naming it, read no further than its format needs and never judged around (never a pass); under every
CPython 3.10-3.13 present here, the fast path says the same (no SystemError, no internal error).

The time and memory these take are measured in bench/bench_guard.py --hostile (never in a timed test).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.errors import error_lines
from tests.releases import stat_snapshot


def _cut(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _padded(size):
    def pad(path):
        with open(path, "r+b") as fh:  # sparse: the size, no disk
            fh.truncate(size)

    return pad


def _text(data: bytes):
    return lambda path: path.write_bytes(data)


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _symlink(path):
    path.rename(path.with_name(path.name + ".real"))
    path.symlink_to(path.name + ".real")


def _directory(path):
    path.unlink()
    path.mkdir()


def _wrong_field(path):
    document = json.loads(path.read_text())
    document["files"] = []
    path.write_text(json.dumps(document))


#: Each manifest.json, and a word of what is said about it (beside "manifest.json").
MANIFESTS = {
    "cut": (_cut, "not JSON"),
    "padded-60MiB": (_padded(60 << 20), "60.0 MiB"),
    "nested": (_text(b"[" * 5_000), "not JSON"),  # nested too deeply, or (3.13) cut short: each one line
    "a-flood-of-values": (_text(b"[" + b"{}," * 100_000 + b"{}]"), "more than 20,000 JSON values"),
    "a-long-integer": (_text(b'{"schema": ' + b"9" * 100_000 + b"}"), "digits"),
    "nan": (_text(b'{"schema": NaN}'), "NaN"),
    "a-bom": (_text(b'\xef\xbb\xbf{"schema": 2}'), "BOM"),
    "not-utf8": (_text(b'{"schema": "\xff"}'), "not UTF-8"),
    "not-an-object": (_text(b"[]"), "object"),
    "a-fifo": (_fifo, "not a regular file"),
    "a-symlink": (_symlink, "symbolic link"),
    "a-directory": (_directory, "not a regular file"),
    "a-wrong-field": (_wrong_field, "files is not an object"),
}


def _one_line(result, *words) -> str:
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _guard_says(tree, running, monkeypatch, *words, expect: str | None = None) -> str:
    """The strict guard's message on ``tree``: it names the file, and the tree is never judged in full for it."""

    def judged_in_full(*_args):
        raise AssertionError("judged in full")

    running(tree)
    monkeypatch.setattr(guard, "_full_judgement", judged_in_full)
    monkeypatch.setenv(guard.ENV, "strict")
    if expect:
        monkeypatch.setenv(guard.EXPECT, expect)
    with pytest.raises(guard.PatchesNotInPlace) as raised:
        guard.check()
    message = str(raised.value)
    assert message.startswith("patch-dsv4 cannot check this vLLM: "), message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_hostile_manifest_is_one_line_never_a_pass_and_apply_rebuilds_it(case, make_tree, cli, running, monkeypatch):
    """verify, status and the guard refuse it in one line naming it, and name the repair: apply, which rebuilds the
    state from proof alone and keeps the manifest it could not read (never deleted)."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    state = tree / ".patch-dsv4"
    written = (state / "manifest.json").read_bytes()
    damage, word = MANIFESTS[case]
    damage(state / "manifest.json")
    damaged = os.lstat(state / "manifest.json")
    before = stat_snapshot(tree)
    repair = f"(next: patch-dsv4 apply --site-packages {tree} (rebuilds it with pip's bytes from their backups in"
    for command in ("verify", "status"):
        line = _one_line(cli(command, "--site-packages", tree), "unreadable state", "manifest.json", word)
        assert repair in line, line
    assert stat_snapshot(tree) == before  # refused: nothing written
    message = _guard_says(tree, running, monkeypatch, "manifest.json", word)
    assert "run patch-dsv4 apply --python " in message and "rebuilds it from proof" in message

    rebuilt = cli("apply", "--site-packages", tree, "--json")
    assert rebuilt.code == 0, rebuilt.stderr
    (note,) = [n for n in rebuilt.json()["notes"] if "rebuilt" in n]
    assert note.startswith("rebuilt the state (5 file(s), vLLM 0.30.0): pip's bytes from their backups in ")
    (kept,) = glob.glob(str(state / "saved-edits" / "*" / "manifest.json.unreadable"))
    assert f"the unreadable manifest kept in .patch-dsv4/saved-edits/{kept.split('/')[-2]}/" in note
    assert os.lstat(kept)[:2] == damaged[:2]  # the very file (mode, inode), set aside
    assert json.loads((state / "manifest.json").read_text())["files"] == json.loads(written)["files"]
    assert cli("verify", "--site-packages", tree).code == 0
    again = stat_snapshot(tree)
    assert cli("apply", "--site-packages", tree).code == 0 and stat_snapshot(tree) == again  # a no-op, truly


def test_a_symlinked_state_directory_is_refused_naming_it(make_tree, cli, running, monkeypatch, tmp_path):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    shutil.move(tree / ".patch-dsv4", tmp_path / "elsewhere")
    (tree / ".patch-dsv4").symlink_to(tmp_path / "elsewhere")
    _one_line(cli("verify", "--site-packages", tree), ".patch-dsv4")
    _guard_says(tree, running, monkeypatch, ".patch-dsv4 is a symbolic link")


# -- the lock ------------------------------------------------------------------------------------------------------
def test_a_lock_held_with_a_hostile_holder_line_is_named_in_bounds(make_tree, cli, running, monkeypatch):
    """Escape sequences and 10 MiB in the lock file, held by another process: the guard names the holder in at
    most 200 printable characters; nothing blocks."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    lock = tree / ".patch-dsv4.lock"
    lock.write_bytes(b"pid 1 \x1b[31mred\x1b[0m \x07" + b"x" * (10 << 20) + b"\nsecond line\n")
    with open(lock, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        running(tree)
        monkeypatch.setenv(guard.ENV, "strict")
        with pytest.raises(guard.PatchesNotInPlace) as raised:
            guard.check()
    message = str(raised.value)
    assert "an apply or revert is writing this vLLM's files now (pid 1 ?[31mred?[0m ?xxx" in message
    assert "\x1b" not in message and "\x07" not in message and "second line" not in message
    assert len(message) < 600


@pytest.mark.parametrize("odd", ["a-fifo", "a-symlink", "a-directory"])
def test_an_odd_lock_file_never_blocks_and_apply_refuses_it_in_a_line(odd, make_tree, cli, running, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    lock = tree / ".patch-dsv4.lock"
    if odd == "a-fifo":
        os.mkfifo(lock)
    elif odd == "a-symlink":
        lock.symlink_to("/etc/hostname")
    else:
        lock.mkdir()
    verify = cli("verify", "--site-packages", tree)  # the state vouches: verify never takes the lock
    assert verify.code == 0, verify.stderr
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    guard.check()  # no writer it can tell: the files decide, and they are ours
    _one_line(cli("revert", "--site-packages", tree), "lock")


# -- backups ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("odd", ["a-fifo", "huge", "a-symlink"])
def test_an_odd_backup_is_one_line_and_restores_nothing(odd, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    backup = tree / ".patch-dsv4" / "backups" / VL_MODEL
    if odd == "a-fifo":
        _fifo(backup)
    elif odd == "huge":
        _padded(4 << 30)(backup)
    else:
        _symlink(backup)
    before = stat_snapshot(tree)
    result = cli("revert", "--site-packages", tree)
    assert result.code in (1, 2) and len(error_lines(result.stderr)) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert stat_snapshot(tree) == before


# -- vLLM's dist-info ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    ["metadata-100MiB-line", "metadata-a-fifo", "wheel-a-fifo", "wheel-padded", "record-padded", "record-a-bad-line"],
)
def test_a_hostile_dist_info_is_one_line_and_the_guard_names_it(case, make_tree, cli, running, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    expected = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
    dist = tree / "vllm-0.30.0.dist-info"
    name = case.split("-")[0].upper()
    path = dist / name
    if case == "metadata-100MiB-line":
        text = path.read_text()
        head, _, rest = text.partition("\n")
        path.write_text(head + "\nSummary: " + "x" * (100 << 20) + "\n" + rest)
    elif case.endswith("a-fifo"):
        _fifo(path)
    elif case.endswith("padded"):
        _padded(64 << 20)(path)
    else:
        path.write_text(path.read_text().replace(",sha256=", ",sha256", 1))
    if name == "RECORD":  # verify vouches without vLLM's RECORD (nothing it says changes the hashes); status reads it
        assert cli("verify", "--site-packages", tree).code == 0
        _one_line(cli("status", "--site-packages", tree), "RECORD")
        return
    for command in (("verify", "--json"), ("status",), ("apply",)):  # verify's table reads no WHEEL: no fingerprint
        _one_line(cli(*command, "--site-packages", tree), name)
    message = _guard_says(tree, running, monkeypatch, f"vllm-0.30.0.dist-info/{name}", expect=expected)
    # the repair runs: pip writes its record again, then apply puts our edits back
    assert f"reinstall vllm ({sys.executable} -m pip install --force-reinstall --no-deps vllm==0.30.0)" in message
    assert f"then run patch-dsv4 apply --python {sys.executable}" in message


# -- every CPython the project supports ------------------------------------------------------------------------------
def _interpreter(version: str) -> str | None:
    """An interpreter of ``version`` (3.10, ...) that runs on this machine: this one, one of pyenv's, one on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    candidates = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    candidates += [found] if (found := shutil.which(f"python{version}")) else []
    for python in candidates:
        try:
            said = subprocess.run([python, "-c", "import sys; print(sys.version[:5])"], capture_output=True, text=True)
        except OSError:
            continue
        if said.returncode == 0 and said.stdout.startswith(version):
            return python
    return None


#: What runs under the other interpreter: the guard (strict) and verify's fast path on each tree, from the wheel's
#: layout; one line each: "ok", or the guard's message, or what the fast verify answered.
PROBE = r"""
import io, json, os, sys, types, contextlib
sys.path.insert(0, sys.argv[1])
from patch_dsv4 import cli, guard
os.environ[guard.ENV] = "strict"
for tree in sys.argv[2:]:
    m = types.ModuleType("vllm"); m.__file__ = tree + "/vllm/__init__.py"; sys.modules["vllm"] = m
    guard._reported = False
    guard._full_judgement = lambda *a: (_ for _ in ()).throw(AssertionError("judged in full"))
    try:
        guard.check(); said = "ok"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    with contextlib.redirect_stdout(io.StringIO()):
        fast = cli._fast_verify(["verify", "--site-packages", tree, "-q"])
    print(json.dumps([os.path.basename(os.path.dirname(tree)), said, fast]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13"])
def test_every_cpython_reads_the_hostile_state_the_same(version, make_tree, cli, tmp_path):
    from tests.engine.fastpath.test_guard import _installed_copy

    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (PATH, pyenv)")
    site = _installed_copy(tmp_path)
    trees = {}
    for case in ("good", "cut", "padded-60MiB", "nested", "a-flood-of-values", "a-long-integer", "nan", "not-utf8"):
        tree = make_tree("0.30.0")
        assert cli("apply", "--site-packages", tree).code == 0
        if case != "good":
            MANIFESTS[case][0](tree / ".patch-dsv4" / "manifest.json")
        trees[case] = tree
    legacy = make_tree("0.30.0")
    assert cli("apply", "--site-packages", legacy).code == 0
    (legacy / ".patch-dsv4" / "stat-keys.json").write_text('{"format": 1, "files": {"vllm/x.py": [1, 2, 3')
    trees["legacy-stat-keys-cut"] = legacy
    run = subprocess.run(
        [python, "-I", "-c", PROBE, str(site), *(str(t) for t in trees.values())],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert run.returncode == 0, run.stderr
    said = {case: json.loads(line)[1:] for case, line in zip(trees, run.stdout.splitlines(), strict=True)}
    assert said["good"] == ["ok", 0] and said["legacy-stat-keys-cut"] == ["ok", 0]
    for case in trees.keys() - {"good", "legacy-stat-keys-cut"}:
        message, fast = said[case]
        assert message.startswith("PatchesNotInPlace: patch-dsv4 cannot check this vLLM: manifest.json "), message
        assert MANIFESTS[case][1] in message and "SystemError" not in message, message
        assert fast is None  # verify's fast path leaves it to the full path, which says the same line
