"""The serve guard on real release trees, with this process playing the vLLM that imported it.

(The guard called by vLLM's own load_general_plugins(), in a real install, is in
tests/integration/.)
"""

from __future__ import annotations

import logging
import sys

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import PINNED_FLASHINFER, hand_edit, install_flashinfer_sources


def _records(caplog):
    """Our log records, but for the DEBUG line that gives the fingerprint before a report (test_serving.py)."""
    return [
        r
        for r in caplog.records
        if r.name == "vllm.patch_dsv4" and not r.getMessage().startswith("patch-dsv4: this vLLM serves ")
    ]


def test_an_applied_tree_is_silent(make_tree, cli, running, monkeypatch, caplog):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    running(tree)
    for mode in ("warn", "strict"):
        monkeypatch.setenv(guard.ENV, mode)
        with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
            guard.check()
    assert [r.levelno for r in _records(caplog)] == [logging.DEBUG, logging.DEBUG]


def test_a_pristine_known_build_is_decided_from_anchors_without_judging(make_tree, running, monkeypatch, caplog):
    tree = make_tree("0.30.0")
    running(tree)
    monkeypatch.setattr(guard, "_full_judgement", lambda *_: pytest.fail("a known build needs no full judgement"))
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
        guard.check()  # once per process
    (record,) = _records(caplog)
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    # the recorded V4.1 files too (anchors/): the vision class in nvidia/ and amd/, the SM120 prefill
    assert (
        "stream-load is pending (vllm/models/deepseek_v4/common/vl_model.py, vllm/models/deepseek_v41/amd/vl_model.py, "
        "vllm/models/deepseek_v41/nvidia/vl_model.py)"
    ) in message
    assert (
        "wide-swa is pending (vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py, "
        "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py)"
    ) in message
    assert "dtype-policy" not in message
    assert f"patch-dsv4 apply --python {sys.executable}" in message


def test_a_real_install_with_the_pinned_flashinfer_installed_takes_the_fast_paths(
    make_tree, cli, running, monkeypatch, caplog
):
    """A real install has FlashInfer installed, not pinned: the records of --no-deps trees still answer for it."""
    tree = make_tree("0.30.0")
    install_flashinfer_sources(tree, PINNED_FLASHINFER["0.30.0"])
    running(tree)
    monkeypatch.setattr(guard, "_full_judgement", lambda *_: pytest.fail("the recorded verdicts should answer"))
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()  # pristine: from anchors/
    assert "stream-load is pending" in _records(caplog)[-1].getMessage()
    assert cli("apply", "--site-packages", tree).code == 0
    monkeypatch.setattr(guard, "_reported", False)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()  # applied: from the state's recorded verdicts
    assert [r.levelno for r in _records(caplog)] == [logging.DEBUG]


def test_strict_raises_and_off_is_silent(make_tree, running, monkeypatch, caplog):
    tree = make_tree("0.28.0")
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="dtype-policy is pending.*loader-skips is pending"):
        guard.check()
    monkeypatch.setenv(guard.ENV, "off")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
    assert _records(caplog) == []


def test_a_hand_edited_patched_file_is_named(make_tree, cli, running, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local edit\n")
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="stream-load is modified"):
        guard.check()


def test_a_patched_file_rewritten_in_place_at_once_after_apply_is_named(make_tree, cli, running, monkeypatch):
    """One byte changed in the file itself (same inode, same size), its mtime set back, right after apply: the stat
    key apply recorded no longer holds (ctime moved), so the guard reads the file and names the patch."""
    import os

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    path = tree / VL_MODEL
    data, st = path.read_bytes(), os.stat(path)
    at = data.index(b"# ") + 2
    with open(path, "r+b") as fh:
        fh.write(data[:at] + (b"X" if data[at : at + 1] != b"X" else b"Y") + data[at + 1 :])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_ino, os.stat(path).st_size, os.stat(path).st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="stream-load is modified"):
        guard.check()


def test_an_unknown_build_is_judged_in_full(make_tree, running, monkeypatch):
    tree = make_tree("0.30.0")
    metadata = next(tree.glob("vllm-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.30.0", "Version: 0.30.1.dev3+gabc", 1))
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="stream-load is pending"):
        guard.check()


def test_a_bug_in_the_guard_never_stops_vllm_in_warn_mode(make_tree, running, monkeypatch, caplog):
    running(make_tree("0.30.0"))
    monkeypatch.setattr(guard, "_judge", lambda: 1 / 0)
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING and "ZeroDivisionError" in record.getMessage()
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="could not check"):
        guard.check()


HEAVY = (
    "libcst",
    "typer",
    "rich",
    "packaging",
    "importlib.metadata",
    "patch_dsv4.pipeline.commands",
    "patch_dsv4.tree.state",
)


def _heavy_modules_after(code: str) -> list[str]:
    import subprocess

    probe = code + f"; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])


def test_the_guard_module_imports_nothing_heavy():
    assert _heavy_modules_after("import sys; import patch_dsv4.guard") == []


@pytest.mark.parametrize("applied", [True, False], ids=["applied-tree", "pristine-known-build"])
def test_the_guard_decides_without_importing_anything_heavy(applied, make_tree, cli):
    """Its check, in a fresh interpreter playing the vLLM of the tree: no libcst, Typer, rich or state module."""
    tree = make_tree("0.30.0")
    install_flashinfer_sources(tree, PINNED_FLASHINFER["0.30.0"])
    if applied:
        assert cli("apply", "--site-packages", tree).code == 0
    code = (
        "import sys, types, logging; logging.basicConfig(level=logging.DEBUG);"
        f"m = types.ModuleType('vllm'); m.__file__ = {str(tree / 'vllm' / '__init__.py')!r}; sys.modules['vllm'] = m;"
        "import patch_dsv4.guard as g; g.check()"
    )
    assert _heavy_modules_after(code) == []


# -- the first call's cost: what it reads and imports in a cold interpreter (bench/bench_guard.py times it) --------
def _installed_copy(tmp_path):
    """This checkout laid out as pip installs its wheel: site/patch_dsv4 (patches/ and anchors/ inside) and a
    dist-info whose RECORD, written last, gives each file's sha256 and size."""
    import base64
    import hashlib
    import shutil
    from pathlib import Path

    import patch_dsv4
    import patch_dsv4.anchors
    import patch_dsv4.patches

    site = tmp_path / "site"
    package = site / "patch_dsv4"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(patch_dsv4.__file__).parent, package, ignore=skip)
    for sub in (patch_dsv4.patches, patch_dsv4.anchors):
        shutil.copytree(Path(sub.__file__).parent, package / sub.__name__.rpartition(".")[2], ignore=skip)
    lines = []
    for path in sorted(p for p in package.rglob("*") if p.is_file()):
        sha = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(site).as_posix()},sha256={sha},{path.stat().st_size}")
    dist = site / f"patch_dsv4-{patch_dsv4.__version__}.dist-info"
    dist.mkdir()
    (dist / "RECORD").write_text("\n".join([*lines, f"{dist.name}/RECORD,,"]) + "\n")
    return site


def _in_bare_interpreter(site, code: str, env=None) -> str:
    """``code`` in a fresh ``python -I -S`` (no site: nothing imported but what the interpreter starts with) that
    imports patch_dsv4 from ``site``; its last line of output."""
    import subprocess

    probe = f"import sys; sys.path.insert(0, {str(site)!r}); import patch_dsv4; "
    probe += f"assert patch_dsv4.__file__.startswith({str(site)!r}); " + code
    run = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, env=env or {})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


def test_installed_from_a_wheel_the_patch_digest_comes_from_record_unless_a_file_changed_since(tmp_path):
    """The digest the state records, read from RECORD where the files are as RECORD says; a file modified after
    RECORD was written, or of another size, is read: the digest stays that of the files."""
    import os

    from patch_dsv4.fastpath import quick

    site = _installed_copy(tmp_path)
    digest = "from patch_dsv4.fastpath import quick; print(quick.patch_digest())"
    assert _in_bare_interpreter(site, digest) == quick.patch_digest()  # this checkout's files, read
    record = next(site.glob("patch_dsv4-*.dist-info")) / "RECORD"
    text = record.read_text()
    line = next(x for x in text.splitlines() if x.startswith("patch_dsv4/guard.py,"))
    rel, _, size = line.rsplit(",", 2)
    record.write_text(text.replace(line, f"{rel},sha256={'A' * 43},{size}"))  # another sha256, the same size
    guard_py = site / "patch_dsv4" / "guard.py"
    stamp = record.stat().st_mtime_ns
    os.utime(guard_py, ns=(stamp, stamp - 10**9))  # older than RECORD, its size: RECORD's sha256 stands
    assert _in_bare_interpreter(site, digest) != quick.patch_digest()
    os.utime(guard_py, ns=(stamp, stamp + 10**9))  # modified after RECORD: read
    assert _in_bare_interpreter(site, digest) == quick.patch_digest()
    os.utime(guard_py, ns=(stamp, stamp - 10**9))
    guard_py.write_bytes(guard_py.read_bytes() + b"\n")  # another size (and a new mtime): read, another digest
    os.utime(guard_py, ns=(stamp, stamp - 10**9))
    changed = _in_bare_interpreter(site, digest)
    assert changed != quick.patch_digest()
    record.write_text(text)
    assert _in_bare_interpreter(site, digest) == changed  # a true RECORD but for that file: the file read


#: What vLLM has imported before it calls its plugins, of what the guard reads with (bench/bench_guard.py:
#: VLLM_PRELOADED): json to read the state, hashlib to hash the files.
PRELOADED = ("logging", "json", "hashlib", "re", "fcntl")
#: What the guard's first call does without, even there: the typed model and the engine's readers (typing, dataclasses,
#: inspect: several ms in a cold interpreter), base64 and csv (RECORD is read without them), importlib.metadata,
#: packaging, and any CPython module of its own that no public one imported.
COSTLY = (
    *("typing", "dataclasses", "inspect", "base64", "binascii", "csv", "email"),
    *("importlib.metadata", "packaging", "libcst", "patch_dsv4.tree.state", "patch_dsv4.pipeline"),
)


@pytest.mark.parametrize("expect", [False, True], ids=["alone", "with-PATCH_DSV4_EXPECT"])
def test_the_guards_first_call_imports_nothing_costly_beyond_what_vllm_has(expect, tmp_path, make_tree, cli):
    """On an applied tree, from a wheel's layout, in an interpreter that has imported what vLLM has before it calls
    its plugins: the fast path decides (strict: any problem would raise), importing none of COSTLY."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    site = _installed_copy(tmp_path)
    env = {guard.ENV: "strict"}
    if expect:
        env[guard.EXPECT] = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
    code = (
        f"[__import__(name) for name in {PRELOADED!r}]; "
        f"m = type(sys)('vllm'); m.__file__ = {str(tree / 'vllm' / '__init__.py')!r}; sys.modules['vllm'] = m; "
        "before = set(sys.modules); import patch_dsv4.guard as g; g.check(); new = set(sys.modules) - before; "
        "g._full_judgement = None; g.judge_this_vllm(); "  # the fast path decided: a full judgement would fail here
        f"print(sorted(n for n in new if n.partition('.')[0] in {COSTLY!r} or n in {COSTLY!r}), "
        "'patch_dsv4.fastpath.serving' in new)"
    )
    assert _in_bare_interpreter(site, code, env) == f"[] {expect}"


@pytest.mark.parametrize("known", [True, False], ids=["known-build", "judged-in-full"])
def test_strict_lets_vllm_034_start(known, make_tree, running, monkeypatch, caplog):
    """vLLM 0.34.0 needs no default patch (stream-load, dtype-policy upstream): the strict guard lets it start,
    whether the build is decided from anchors/ or, for an unrecorded build, judged in full."""
    tree = make_tree("0.34.0")
    if not known:  # a file no release ships in the DeepSeek-V4 package: an unknown build
        (tree / "vllm" / "models" / "deepseek_v4" / "notes.py").write_text("# a local addition\n")
    full = []
    judge_in_full = guard._full_judgement
    monkeypatch.setattr(guard, "_full_judgement", lambda *a: full.append(1) or judge_in_full(*a))
    running(tree)
    monkeypatch.setenv(guard.ENV, "strict")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()  # raises in strict mode if a patch this vLLM needs were missing
    assert bool(full) is not known
    assert not [r for r in _records(caplog) if r.levelno >= logging.WARNING], [r.getMessage() for r in _records(caplog)]
