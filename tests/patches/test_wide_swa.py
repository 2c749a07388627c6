"""wide-swa: verdicts on the real releases (pinned and installed FlashInfer), its scope,
the private FlashInfer API its sliced path binds to, and its run-time gate.

The numerics of the injected slicing code are in test_wide_swa_numerics.py (CPU torch)."""

from __future__ import annotations

import ast
import sys
import types
import zipfile

import pytest

from patch_dsv4.patches import wide_swa
from patch_dsv4.patches.wide_swa import FLASHINFER_SPARSE, SM120_CLASS
from patch_dsv4.patching.edits import helper_source
from tests.records import recorded_verdict
from tests.releases import (
    PINNED_FLASHINFER,
    RELEASES,
    hand_edit,
    install_flashinfer_sources,
    rewrite_record,
    stat_snapshot,
    wheel,
)

PREFIX = "_patch_dsv4_wide_swa_"
#: FlashInfer releases whose dual-cache prefill takes 128-wide rows: the sliced path's API.
SLICED_FLASHINFER = ("0.6.16.post3", "0.6.18", "0.6.18.post1")
WIDE_FLASHINFER = ("0.7.0.post1", "0.7.2.post1")


@pytest.mark.parametrize("version", RELEASES)
def test_evidence_names_the_flashinfer_it_judged(version, make_tree, cli):
    result = cli("status", "--site-packages", make_tree(version), "--json")
    report = result.json()
    assert (report["flashinfer_version"], report["flashinfer_source"]) == (PINNED_FLASHINFER[version], "pinned")
    patch = result.patch("wide-swa")
    assert patch["verdict"] == recorded_verdict(version, "wide-swa")
    if patch["verdict"] == "upstream":
        assert "fixed in FlashInfer 0.7.0" in patch["detail"] and PINNED_FLASHINFER[version] in patch["detail"]
    if patch["verdict"] == "upstream":  # status stays offline: the pin is not looked up
        assert "none installed: the verdict rests on the pin, not checked against pip's index" in patch["detail"]
    if patch["verdict"] == "not-applicable":
        assert "prefill_index_width" in patch["detail"]


# -- installed FlashInfer: judged by the kernel source its wheel ships ---------------
@pytest.mark.parametrize(
    "version,flashinfer,expected",
    [
        ("0.30.0", "0.7.0.post1", "upstream"),
        ("0.30.0", "0.7.2.post1", "upstream"),
        ("0.31.0", "0.6.18.post1", "pending"),
        ("0.33.0", "0.6.16.post3", "pending"),
        # 0.34.0 pins 0.7.3, which the index does not serve: users run 0.7.2.post1 (left from 0.33.0) or 0.7.4
        ("0.34.0", "0.7.2.post1", "upstream"),
        ("0.34.0", "0.7.4", "upstream"),
    ],
)
def test_verdict_with_installed_flashinfer(version, flashinfer, expected, make_tree, cli):
    tree = make_tree(version)
    install_flashinfer_sources(tree, flashinfer)
    result = cli("status", "--site-packages", tree, "--json")
    assert result.code == 0, result.stderr
    assert (result.json()["flashinfer_version"], result.json()["flashinfer_source"]) == (flashinfer, "installed")
    patch = result.patch("wide-swa")
    assert patch["verdict"] == expected, patch
    if expected == "upstream":
        assert f"installed FlashInfer {flashinfer}" in patch["detail"]


def test_flashinfer_upgraded_after_patching_keeps_our_edit_applied(make_tree, cli):
    """Our code stays (its run-time gate now takes the kernel's path): applied, not upstream."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    install_flashinfer_sources(tree, "0.7.0.post1")
    result = cli("verify", "--site-packages", tree, "--json")
    assert result.json()["flashinfer_source"] == "installed"
    assert result.patch("wide-swa")["verdict"] == "applied"
    assert result.code == 0, result.stdout


def test_probe_reads_the_kernel_source_of_each_release():
    """The 128-only guard is in every 0.6.x dual-cache dispatcher and in no 0.7.x one."""
    from patch_dsv4.patching.patch import Context

    for version in SLICED_FLASHINFER + WIDE_FLASHINFER:
        with zipfile.ZipFile(wheel("flashinfer-python", version)) as zf:
            names = set(zf.namelist())

            def read(relpath, zf=zf, names=names):
                return zf.read(relpath) if relpath in names else None

            ctx = Context(version, version, "installed", lambda _rel: None, read)
            limited, evidence = wide_swa.flashinfer_row_limit(ctx)
        assert limited == (version in SLICED_FLASHINFER), (version, evidence)
        assert (".cu" in evidence) if version != "0.7.2.post1" else ("prefill_dispatch.cu" in evidence)


# -- scope: only the SM120 prefill call changes ---------------------------------------
def _methods(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{sub.name}"] = ast.dump(sub)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = ast.dump(node)
    return out


def test_only_the_sm120_prefill_call_changes(make_tree, cli):
    tree = make_tree("0.30.0")
    path = tree / FLASHINFER_SPARSE
    original = path.read_text()
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--only", "wide-swa", "--json")
    assert result.code == 0, result.stderr
    assert result.patch("wide-swa")["verdict"] == "applied"
    after = stat_snapshot(tree)
    changed = {f for f in after if before.get(f) != after[f] and not f.startswith(".patch-dsv4")}
    # and V4.1's own SM120 prefill (tests/patches/test_v41.py), nothing else
    assert changed == {FLASHINFER_SPARSE, "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"}

    old, new = _methods(ast.parse(original)), _methods(ast.parse(path.read_text()))
    scope = f"{SM120_CLASS}._forward_prefill"
    added = set(new) - set(old)
    assert added and all(name.startswith(PREFIX) for name in added)
    assert {n for n in old if old[n] != new[n]} == {scope}
    assert f"{SM120_CLASS}._forward_decode" in old  # the decode call is a look-alike left alone

    method = next(
        sub
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == SM120_CLASS
        for sub in node.body
        if isinstance(sub, ast.FunctionDef) and sub.name == "_forward_prefill"
    )
    (branch,) = [n for n in ast.walk(method) if isinstance(n, ast.If) and PREFIX in ast.unparse(n.test)]
    (unchanged,) = branch.orelse
    assert ast.dump(unchanged) == ast.dump(ast.parse(wide_swa.ANCHOR).body[0]), "the else branch is the original call"


def test_look_alike_outside_the_prefill_method_is_never_touched(make_tree, cli):
    """The exact anchor statement, planted in SM120 _forward_decode and at module level."""
    tree = make_tree("0.30.0")
    path = tree / FLASHINFER_SPARSE
    text = path.read_text()
    look_alike = "\n".join("        " + line if line else line for line in wide_swa.ANCHOR.strip().splitlines())
    marker = "        swa_indices = swa_metadata.decode_swa_indices\n"
    assert text.count(marker) == 1
    text = text.replace(marker, look_alike + "\n" + marker)
    text += "\n\ndef _look_alike(self, q):\n" + look_alike.replace("\n    ", "\n") + "\n"
    hand_edit(path, text)
    rewrite_record(tree, [FLASHINFER_SPARSE])
    planted = _methods(ast.parse(text))
    assert cli("apply", "--site-packages", tree, "--only", "wide-swa").code == 0
    patched = _methods(ast.parse(path.read_text()))
    assert patched[f"{SM120_CLASS}._forward_decode"] == planted[f"{SM120_CLASS}._forward_decode"]
    assert patched["_look_alike"] == planted["_look_alike"]
    assert patched[f"{SM120_CLASS}._forward_prefill"] != planted[f"{SM120_CLASS}._forward_prefill"]


# -- the private FlashInfer API the sliced path calls, checked against each wheel -----
def _helper_tree(helper) -> ast.FunctionDef:
    (node,) = ast.parse(helper_source(helper)).body
    return node


def _bound_params() -> tuple[str, ...]:
    node = _helper_tree(wide_swa._patch_dsv4_wide_swa_flashinfer_api)
    (assign,) = [n for n in ast.walk(node) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "bound"]
    return ast.literal_eval(assign.value)


def _calls(helper, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(_helper_tree(helper))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
    ]


def _flashinfer_source(version: str, relpath: str) -> ast.Module:
    with zipfile.ZipFile(wheel("flashinfer-python", version)) as zf:
        return ast.parse(zf.read(relpath).decode())


def _private_entry_point(version: str) -> tuple[ast.Module, ast.FunctionDef]:
    """FlashInfer's ``mla/_core.py`` and its ``_trtllm_batch_decode_sparse_mla_sm120``."""
    core = _flashinfer_source(version, "flashinfer/mla/_core.py")
    name = "_trtllm_batch_decode_sparse_mla_sm120"
    (run,) = [n for n in core.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return core, run


@pytest.mark.parametrize("version", SLICED_FLASHINFER)
def test_sliced_path_binds_to_the_flashinfer_06_api(version):
    core, run = _private_entry_point(version)
    args = run.args
    positional = [*args.posonlyargs, *args.args]
    params = [a.arg for a in positional] + [a.arg for a in args.kwonlyargs]
    required = {a.arg for a in positional[: len(positional) - len(args.defaults)]}
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    assert not args.posonlyargs and args.vararg is None
    assert tuple(params) == _bound_params()

    (call,) = _calls(wide_swa._patch_dsv4_wide_swa_sliced_prefill, "run")
    assert not call.args and all(k.arg for k in call.keywords)
    keywords = {k.arg for k in call.keywords}
    assert keywords <= set(params) and required <= keywords

    (segment_cls,) = [n for n in core.body if isinstance(n, ast.ClassDef) and n.name == "_SparseMLASegment"]
    fields = {n.target.id for n in segment_cls.body if isinstance(n, ast.AnnAssign)}
    for call in _calls(wide_swa._patch_dsv4_wide_swa_sliced_prefill, "segment"):
        assert not call.args and {k.arg for k in call.keywords} <= fields

    # The gate's token threshold is FlashInfer's decode/prefill cut-off.
    sm120 = _flashinfer_source(version, "flashinfer/mla/_sparse_mla_sm120.py")
    (cutoff,) = [
        n for n in sm120.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_DECODE_MAX_TOKENS"
    ]
    assert ast.literal_eval(cutoff.value) == 64


@pytest.mark.parametrize("version", WIDE_FLASHINFER)
def test_flashinfer_07_never_reaches_the_sliced_path(version, fake_flashinfer):
    """0.7.x takes the unchanged call, which matters: its private API is not the one bound."""
    fake_flashinfer(version)
    assert not _gate()(_Shape(65, 64, 512), _Shape(65, 1, 512), _Shape(65, 512))
    _, run = _private_entry_point(version)
    params = [a.arg for a in [*run.args.posonlyargs, *run.args.args, *run.args.kwonlyargs]]
    assert tuple(params) != _bound_params()


# -- the run-time gate, with a stand-in FlashInfer module -----------------------------
class _Shape:
    def __init__(self, *shape):
        self.shape = shape


@pytest.fixture
def fake_flashinfer(monkeypatch):
    def install(version: str):
        package = types.ModuleType("flashinfer")
        package.__version__ = version
        monkeypatch.setitem(sys.modules, "flashinfer", package)

    return install


def _gate():
    return wide_swa._patch_dsv4_wide_swa_takes_sliced_path


@pytest.mark.parametrize(
    "tokens,width,extra,expected",
    [
        (65, 512, True, True),
        (8192, 320, True, True),
        (65, 128, True, False),  # rows that fit
        (65, 512, False, False),  # no compressed segment: the single-cache kernel takes 512
        (64, 512, True, False),  # FlashInfer's decode kernels take wide rows
    ],
)
def test_gate(tokens, width, extra, expected, fake_flashinfer):
    fake_flashinfer("0.6.18.post1")
    takes = _gate()
    q, idx = _Shape(tokens, 64, 512), _Shape(tokens, 1, width)
    assert takes(q, idx, _Shape(tokens, 512) if extra else None) is expected


@pytest.mark.parametrize(
    ("listed", "served", "said"),
    [
        ("Available versions: 0.7.4, 0.7.2.post1, 0.7.2", False, "the pin, is not on pip's index (it serves 0.7.4"),
        ("Available versions: 0.7.4, 0.7.3, 0.7.2.post1", True, "the pin, is on pip's index"),
        (None, None, "could not be asked"),
    ],
)
def test_drift_asks_pip_whether_the_pin_is_served(listed, served, said, monkeypatch):
    """drift --vllm-version asks pip's index (``pip index versions``) whether a user can install the pin."""
    import subprocess

    from patch_dsv4.releases import release_wheel

    asked = []

    def run(command, **_kw):
        asked.append(command)
        out = f"flashinfer-python (0.7.4)\n{listed}\n" if listed else ""
        return subprocess.CompletedProcess(command, 0 if listed else 1, out, "")

    monkeypatch.setattr(release_wheel.subprocess, "run", run)
    found, note = release_wheel.flashinfer_pin_served("0.7.3", ["--index-url=https://example.invalid/simple"])
    assert found is served and said in note

    # pip of this interpreter, started without running its start-up hooks (-S, then site's rules without them)
    assert asked[0][1:3] == ["-S", "-c"] and "runpy.run_module('pip'" in asked[0][3]
    assert asked[0][4:7] == ["index", "versions", "flashinfer-python"]
