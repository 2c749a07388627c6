"""The serve guard on real release trees, with this process playing the vLLM that imported it.

(The guard called by vLLM's own load_general_plugins(), in a real install, is in
tests/integration/.)
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from patch_dsv4 import guard
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import PINNED_FLASHINFER, hand_edit, install_flashinfer_sources


@pytest.fixture
def running(monkeypatch):
    """Make the guard see ``tree``'s vLLM as the one this process imported."""

    def run_in(tree):
        module = types.ModuleType("vllm")
        module.__file__ = str(tree / "vllm" / "__init__.py")
        monkeypatch.setitem(sys.modules, "vllm", module)
        monkeypatch.setattr(guard, "_reported", False)

    return run_in


def _records(caplog):
    return [r for r in caplog.records if r.name == "vllm.patch_dsv4"]


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
    monkeypatch.setattr(guard, "judge_this_vllm", lambda: 1 / 0)
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING and "ZeroDivisionError" in record.getMessage()
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="could not check"):
        guard.check()


HEAVY = ("libcst", "typer", "rich", "packaging", "importlib.metadata", "patch_dsv4.commands", "patch_dsv4.state")


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
