"""`patch-dsv4 doctor` end to end: a real vLLM release tree (as `pip install --target` lays it out) with
fake dist-infos for the serving stack, a synthetic pack, stub tools on a PATH the test owns."""

from __future__ import annotations

import json
import platform

import pytest

from tests.conftest import ROOT, run_cli
from tests.doctor.fake_runtime import (
    install_exllamav3,
    install_flashinfer,
    install_guard,
    install_plugin,
    install_torch,
    toolchain,
)
from tests.doctor.synthetic import build_mixedk_pack

SERVE = "--max-model-len 65536 --kv-cache-dtype fp8 --quantization exl3 --enforce-eager"
SCHEMA = json.loads((ROOT / "patcher" / "report.schema.json").read_text())


@pytest.fixture
def serving(make_tree, tmp_path, monkeypatch):
    """vLLM 0.30.0 and its FlashInfer, patched, with vllm-exl3, a compiled exllamav3_ext and torch beside them;
    nvcc and ninja on PATH."""
    tree = make_tree("0.30.0")
    install_flashinfer(tree, "0.6.18.post1")
    assert run_cli("apply", "--site-packages", tree).code == 0
    install_exllamav3(tree, "1.4.5", platform.machine())
    install_plugin(tree)
    install_guard(tree)
    install_torch(tree, "2.13.0+cu130")
    cuda_home, venv_bin, tools = toolchain(tmp_path)
    monkeypatch.setenv("PATH", f"{cuda_home / 'bin'}:{venv_bin}:{tools}")
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    for name in ("VLLM_PLUGINS", "PATCH_DSV4_GUARD", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    return tree


def _doctor(tree, pack, *extra):
    return run_cli("doctor", "--site-packages", tree, "--pack", pack, "--serve-args", SERVE, "--json", *extra)


def _row(result, check_id):
    rows = [r for r in result.json()["checks"] if r["id"] == check_id]
    assert rows, check_id
    return rows


def test_a_healthy_pack_on_a_patched_release_has_no_fail(serving, tmp_path):
    import jsonschema

    pack = build_mixedk_pack(tmp_path / "pack")
    result = _doctor(serving, pack)
    assert result.code == 0, [r for r in result.json()["checks"] if r["status"] == "fail"]
    document = result.json()
    jsonschema.validate(document, SCHEMA)
    assert document["pack"] == str(pack) and document["vllm_version"] == "0.30.0"
    ids = {r["id"] for r in document["checks"]}
    assert {"quant.method", "experts.markers", "rt.patches", "rt.flashinfer-jit", "host.sorted-load"} <= ids
    assert {r["status"] for r in _row(result, "rt.patches")} <= {"pass", "info"}
    table = run_cli("doctor", "--site-packages", serving, "--pack", pack, "--serve-args", SERVE)
    # 80 columns; only a path longer than a line may stand alone on a longer one (it is never folded)
    too_long = [line for line in table.stdout.splitlines() if len(line) > 80 and len(line.split()) > 1]
    assert table.code == 0 and too_long == []
    assert table.stdout.splitlines()[-1].startswith("doctor: ") and "no check fails" in table.stdout


def test_a_pending_patch_fails_with_the_command_that_applies_it(serving, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    assert run_cli("revert", "--site-packages", serving).code == 0
    result = _doctor(serving, pack)
    assert result.code == 1
    failing = [r for r in _row(result, "rt.patches") if r["status"] == "fail"]
    assert {r["detail"].split()[1] for r in failing} == {"stream-load", "wide-swa"}
    assert all(f"patch-dsv4 apply --site-packages {serving}" in r["fix"] for r in failing)


def test_a_pack_fault_fails_its_row_and_fix_config_repairs_it(serving, tmp_path):
    def leftover_fp8(config):
        config["quantization_config"]["quant_method"] = "fp8"

    pack = build_mixedk_pack(tmp_path / "pack", edit_config=leftover_fp8)
    original = (pack / "config.json").read_bytes()
    result = _doctor(serving, pack)
    assert result.code == 1
    (row,) = _row(result, "quant.method")
    assert row["status"] == "fail" and "--fix-config" in row["fix"]
    fixed = _doctor(serving, pack, "--fix-config")
    assert fixed.code == 0, [r for r in fixed.json()["checks"] if r["status"] == "fail"]
    assert fixed.json()["config_fix"]["refused"] is None and '"exl3"' in fixed.json()["config_fix"]["diff"]
    assert (pack / "config.json.bak").read_bytes() == original
    assert _row(fixed, "quant.method")[0]["status"] == "pass"


def test_input_that_cannot_be_used_is_exit_2(serving, tmp_path):
    missing = run_cli("doctor", "--site-packages", serving, "--pack", tmp_path / "absent", "--json")
    assert missing.code == 2 and "no pack directory" in missing.stderr
    assert missing.json()["command"] == "doctor" and missing.json()["checks"] == []
    novllm = run_cli("doctor", "--site-packages", tmp_path, "--json")
    assert novllm.code == 2 and "no vLLM" in novllm.stderr
    unquoted = run_cli("doctor", "--site-packages", serving, "--serve-args", "--speculative-config '{")
    assert unquoted.code == 2 and "--serve-args" in unquoted.stderr
