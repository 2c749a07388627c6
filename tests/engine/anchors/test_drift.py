"""drift on the real releases (wheel and source tree), on releases made to drift, and on unusable input.

A "release made to drift" is a small wheel built from the real one: its
dist-info and the files drift reads, with one source file changed the way a
new vLLM release would change it.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.conftest import RELEASE_PARAMS, CliResult
from tests.errors import error_lines
from tests.releases import DSV4, cache_dir, pristine_tree, wheel

WHEELS = str(cache_dir() / "wheels")


def _status(tree, cli) -> dict:
    result = cli("status", "--site-packages", tree, "--json")
    assert result.code == 0, result.stderr
    return result.json()


def _drift(cli, *args) -> CliResult:
    return cli("drift", *args, "--json")


def _verdicts(data: dict) -> dict[str, tuple[str, str]]:
    return {p["id"]: (p["verdict"], p["detail"]) for p in data["patches"]}


def _prints(data: dict) -> list[dict]:
    return [a for p in data["patches"] for a in p["anchors"]]


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_wheel_and_source_give_status_verdicts(version, make_tree, cli):
    status = _status(make_tree(version), cli)
    for args in (("--wheel", wheel("vllm", version)), ("--source", pristine_tree(version))):
        result = _drift(cli, *args)
        assert result.code == 0, result.stderr or result.stdout
        data = result.json()
        assert data["vllm_version"] == version
        assert (data["flashinfer_version"], data["flashinfer_source"]) == (
            status["flashinfer_version"],
            status["flashinfer_source"],
        )
        assert _verdicts(data) == _verdicts(status), args[0]
        assert data["build"]["known"], data["build"]
        for anchor in _prints(data):
            assert anchor["status"] in ("recorded", "absent"), anchor
            if anchor["status"] == "recorded":
                assert version in anchor["recorded_in"]


def test_fetch_by_version_uses_the_cache(cli):
    result = _drift(cli, "--vllm-version", "0.30.0", "--cache-dir", WHEELS)
    assert result.code == 0, result.stderr
    data = result.json()
    assert data["vllm_version"] == "0.30.0"
    assert any("cached in" in note for note in data["choices"])


def test_reads_only_what_it_needs(cli):
    data = _drift(cli, "--wheel", wheel("vllm", "0.31.0")).json()
    # the evaluator follows the code the probes read into the helpers and base classes it calls (73 files on
    # 0.31.0): a bounded part of the package, never all of it (5,000+ files)
    assert 0 < len(data["files_read"]) < 100, data["files_read"]
    assert all(rel.startswith("vllm/") for rel in data["files_read"])


def test_checkout_without_dist_info(tmp_path, cli, make_tree):
    """A source checkout: the version from vllm/_version.py, the FlashInfer pin from requirements/cuda.txt."""
    version = "0.30.0"
    checkout = tmp_path / "vllm-src"
    checkout.mkdir()
    (checkout / "vllm").symlink_to(pristine_tree(version) / "vllm", target_is_directory=True)
    (checkout / "requirements").mkdir()
    (checkout / "requirements" / "cuda.txt").write_text("torch==2.13.0\nflashinfer-python==0.6.18.post1\n")
    data = _drift(cli, "--source", checkout).json()
    assert data["vllm_version"] == version
    assert (data["flashinfer_version"], data["flashinfer_source"]) == ("0.6.18.post1", "pinned")
    assert any("vllm/_version.py" in c for c in data["choices"])
    assert any("requirements/cuda.txt" in c for c in data["choices"])
    assert _verdicts(data) == _verdicts(_status(make_tree(version), cli))

    named = _drift(cli, "--source", checkout, "--vllm-version", "0.30.1").json()
    assert named["vllm_version"] == "0.30.1"
    assert any("--vllm-version" in c for c in named["choices"])
    assert not named["build"]["known"]


def test_flashinfer_version_overrides_the_pin(cli):
    result = _drift(cli, "--wheel", wheel("vllm", "0.30.0"), "--flashinfer-version", "0.7.0.post1")
    assert result.code == 0, result.stderr
    data = result.json()
    assert (data["flashinfer_version"], data["flashinfer_given"]) == ("0.7.0.post1", True)
    assert any("--flashinfer-version" in c and "0.6.18.post1" in c for c in data["choices"])
    verdicts = {p["id"]: p["verdict"] for p in data["patches"]}
    assert verdicts["wide-swa"] == "upstream"  # FlashInfer 0.7.0.post1 takes the wide rows itself
    evidence = str(next(p for p in data["patches"] if p["id"] == "wide-swa"))
    assert "FlashInfer 0.7.0.post1, as given (--flashinfer-version)" in evidence and "pinned by" not in evidence


# -- releases made to drift ------------------------------------------------------------
@functools.cache
def files_read(version: str) -> frozenset[str]:
    """The files drift reads from the real wheel of ``version``."""
    from tests.conftest import run_cli

    return frozenset(run_cli("drift", "--wheel", wheel("vllm", version), "--json").json()["files_read"])


def mini_wheel(version: str, dest: Path, change=None) -> Path:
    """The real wheel's dist-info, DeepSeek-V4 sources and every file drift reads; ``change(relpath, text)``."""
    real = wheel("vllm", version)
    read = files_read(version)
    path = dest / real.name
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for name in src.namelist():
            keep = ".dist-info/" in name or name in read or name.startswith(DSV4 + "/") or name == "vllm/__init__.py"
            if not keep or name.endswith("/RECORD"):
                continue
            data = src.read(name)
            if change is not None and name.endswith(".py"):
                new = change(name, data.decode())
                data = new.encode() if new is not None else data
            out.writestr(name, data)
    return path


def _replace_once(relpath: str, old: str, new: str):
    def change(name: str, text: str) -> str | None:
        if name != relpath:
            return None
        assert text.count(old) == 1, f"{old!r} is not once in {name}"
        return text.replace(old, new)

    return change


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0"])
def test_changed_anchor_is_drifted(version, tmp_path, cli):
    whl = mini_wheel(version, tmp_path, _replace_once(VL_MODEL, "key=lambda x: x[0]", "key=lambda item: item[0]"))
    result = _drift(cli, "--wheel", whl)
    assert result.code == 1, result.stdout
    # beside the JSON, the file that drifted (V4.1's vision classes are pending there: not named)
    assert "patch-dsv4: error: stream-load is drifted in common/vl_model.py" in result.stderr.splitlines()
    data = result.json()
    (patch,) = [p for p in data["patches"] if p["id"] == "stream-load"]
    assert patch["verdict"] == "drifted"
    (edit,) = [e for e in patch["edits"] if e["file"] == VL_MODEL]
    assert "iter(sorted(mapped, key=lambda x: x[0]))" in edit["expected"]
    assert "lambda item: item[0]" in edit["found"]
    assert [a["status"] for a in patch["anchors"] if a["file"] == VL_MODEL] == ["drifted"]
    assert not data["build"]["known"]
    assert "drifted" in data["summary"]
    table = cli("drift", "--wheel", whl)  # where, at once; the code expected and found under -v
    assert table.code == 1 and "      common/vl_model.py: anchor not found (load_weights)" in table.stdout.splitlines()
    assert "expected:" not in table.stdout
    verbose = cli("drift", "--wheel", whl, "-v")
    assert verbose.code == 1 and "expected:" in verbose.stdout and "found:" in verbose.stdout
    markdown = cli("drift", "--wheel", whl, "--format", "markdown")
    assert markdown.code == 1 and "```python" in markdown.stdout


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_reformatted_release_is_not_drifted(version, tmp_path, cli, make_tree):
    from tests.reformat import reformat_source

    def change(name, text):  # black is slow: only the files drift reads
        return reformat_source(text) if name in files_read(version) else None

    pristine = _drift(cli, "--wheel", wheel("vllm", version)).json()
    for args in (
        ("--wheel", mini_wheel(version, tmp_path, change)),
        ("--source", make_tree(version, reformatted=True)),
    ):
        result = _drift(cli, *args, "--strict")
        assert result.code == 0, result.stdout
        data = result.json()
        assert _verdicts(data) == _verdicts(pristine)
        assert [(a["fingerprint"], a["status"]) for a in _prints(data)] == [
            (a["fingerprint"], a["status"]) for a in _prints(pristine)
        ]
        assert not data["build"]["known"]  # other bytes, same code


def test_function_changed_elsewhere_is_new(tmp_path, cli):
    change = _replace_once(
        VL_MODEL,
        "mapped = self.hf_to_vllm_mapper.apply(weights)",
        "mapped = self.hf_to_vllm_mapper.apply(list(weights))",
    )
    whl = mini_wheel("0.30.0", tmp_path, change)
    result = _drift(cli, "--wheel", whl)
    assert result.code == 0, result.stdout
    data = result.json()
    (patch,) = [p for p in data["patches"] if p["id"] == "stream-load"]
    assert patch["verdict"] == "pending"
    (anchor,) = [a for a in patch["anchors"] if a["file"] == VL_MODEL]
    assert anchor["status"] == "new" and anchor["recorded_in"] == []
    strict = _drift(cli, "--wheel", whl, "--strict")
    assert strict.code == 1
    assert "--strict" in strict.json()["summary"]


# -- unusable input ------------------------------------------------------------------
def _one_line_error(result, *words):
    """Exit 2 and one error (progress lines, such as a fetch's, may come before it): what, why and next on lines
    of their own within 80 columns (tests.errors.error_lines joins them)."""
    assert result.code == 2, (result.stdout, result.stderr)
    errors = [line for line in error_lines(result.stderr) if not line.startswith("patch-dsv4: fetch")]
    assert len(errors) == 1 and errors[0].startswith("patch-dsv4: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in errors[0], errors


def test_missing_file(tmp_path, cli):
    _one_line_error(cli("drift", "--wheel", tmp_path / "vllm-9.9.9-py3-none-any.whl"), "no such file")


def test_not_a_wheel(tmp_path, cli):
    text = tmp_path / "vllm-0.30.0-py3-none-any.whl"
    text.write_text("not a zip\n")
    _one_line_error(cli("drift", "--wheel", text), "not a wheel", "not a zip")
    empty_zip = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty_zip, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
    _one_line_error(cli("drift", "--wheel", empty_zip), "not a wheel", "METADATA")


def test_wheel_of_another_package(cli):
    _one_line_error(cli("drift", "--wheel", wheel("flashinfer-python", "0.6.18")), "flashinfer", "not of vLLM")


def test_version_that_does_not_exist(tmp_path, cli):
    _one_line_error(cli("drift", "--vllm-version", "0.0.0.post777", "--cache-dir", tmp_path), "vllm==0.0.0.post777")
    _one_line_error(cli("drift", "--vllm-version", "not-a-version", "--cache-dir", tmp_path), "not a valid")


def test_source_without_vllm(tmp_path, cli):
    _one_line_error(cli("drift", "--source", tmp_path), "no vllm/ package")
    _one_line_error(cli("drift", "--source", tmp_path / "absent"), "no such directory")
    _one_line_error(cli("drift"), "no release to judge")
    json_error = cli("drift", "--source", tmp_path, "--json")
    assert json_error.code == 2 and json_error.json()["exit_code"] == 2


def test_a_new_release_is_compared_with_the_nearest_recorded_one(tmp_path):
    """Release day: vLLM 0.33.0 judged as if only 0.30.0-0.32.0 were recorded. stream-load changed verdict: the
    note names the verdicts, each function before and after (fingerprints), and the evidence now; patches whose
    verdict stayed get no note."""
    import shutil

    from patch_dsv4.pipeline.drift import drift, nearest_recorded
    from patch_dsv4.releases import anchors_store
    from patch_dsv4.releases.release_target import open_wheel

    for version in ("0.30.0", "0.31.0", "0.32.0"):
        shutil.copy(anchors_store.anchors_path(version), tmp_path)
    with open_wheel(wheel("vllm", "0.33.0")) as target:
        report = drift(target, anchors_dir=tmp_path).report
    changes = [n for n in report.notes if "(the nearest recorded release)" in n]
    assert len(changes) == 1, report.notes
    (note,) = changes
    recorded = anchors_store.load("0.32.0")["patches"]["stream-load"]["anchors"][0]
    assert note.startswith("stream-load: upstream on vLLM 0.33.0, pending on vLLM 0.32.0 (the nearest recorded")
    assert f"{VL_MODEL}:DeepseekV4ForConditionalGeneration.load_weights was pending ({recorded['fingerprint']})" in note
    now = anchors_store.load("0.33.0")["patches"]["stream-load"]["anchors"][0]["fingerprint"]
    assert f"is upstream ({now})" in note and "now: " in note and "stream_language_model_first" in note
    assert nearest_recorded("0.29.0", {"0.30.0": {}, "0.32.0": {}}) == "0.30.0"  # nothing older: the oldest
    assert nearest_recorded("0.35.0rc1", {"0.30.0": {}, "0.34.0": {}}) == "0.34.0"
