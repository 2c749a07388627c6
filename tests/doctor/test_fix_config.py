"""``doctor --fix-config``: the edits, the diff, the kept original, atomic and idempotent writes, refusals."""

from __future__ import annotations

import json
import os
import stat

import pytest

from patch_dsv4.doctor.fix_config import fix_config
from patch_dsv4.doctor.readers.base import FAIL, PASS
from patch_dsv4.tree.fs import inject_faults
from tests.doctor.synthetic import (
    DSPARK,
    SMALL,
    build_lna_dense_pack,
    build_mixedk_pack,
    routed_experts,
    run_pack_checks,
)

BASE_MODEL_QUANT = {  # the leftover declaration of DeepSeek-V4-Flash itself
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


def as_downloaded(config: dict) -> None:
    """The pack as the issues describe it: the base model's fp8 block, no topk_method, an empty text_config."""
    config["quantization_config"] = dict(BASE_MODEL_QUANT)
    del config["topk_method"]
    config["text_config"] = {}


def fork_route(config: dict) -> None:
    """The Hub pack as of 2026-09-01: the fork's policy, MixedK map and draft keys missing."""
    quant = config["quantization_config"]
    quant["non_routed_dtype_policy"] = "official_source_native"
    del quant["layer_bits"], quant["mtp_experts"], quant["mtp_experts_start_layer"]


def bad_codebook_and_bits(config: dict) -> None:
    config["quantization_config"].update(codebook="mul1", bits=7)


FIXED_ROWS = (
    "pack.text-config",
    "quant.method",
    "quant.bits",
    "quant.codebook",
    "quant.layer-bits",
    "dense.policy",
    "mtp.format",
    "config.topk-method",
)


@pytest.mark.parametrize(
    "broken",
    [as_downloaded, fork_route, bad_codebook_and_bits],
    ids=["base_model_block", "fork_route", "codebook_and_bits"],
)
def test_the_fixed_pack_passes_the_rows_it_fixed(broken, tmp_path, stock_vllm):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=broken)
    before = run_pack_checks(pack, DSPARK, stock_vllm)
    failing = {r for r in FIXED_ROWS if before[r].status != PASS}
    assert failing
    result = fix_config(pack)
    assert result.refused is None and result.changed
    after = run_pack_checks(pack, DSPARK, stock_vllm)
    assert {r: after[r].status for r in failing} == {r: PASS for r in failing}
    assert all(row.status == PASS for row in after.values())


def test_the_edits_fill_what_the_rows_need_and_keep_every_other_key(tmp_path):
    def broken(config):
        as_downloaded(config)
        config["quantization_config"]["my_note"] = "keep me"
        config["rope_scaling"] = {"factor": 16}

    pack = build_mixedk_pack(tmp_path / "pack", edit_config=broken)
    fix_config(pack)
    config = json.loads((pack / "config.json").read_text())
    assert config["quantization_config"] == {
        **BASE_MODEL_QUANT,
        "quant_method": "exl3",
        "my_note": "keep me",
        "bits": 2,
        "non_routed_dtype_policy": "bf16_as_stored",
        "layer_bits": {"2": 3},
        "mtp_experts": "source",
        "mtp_experts_start_layer": 4,
        "non_routed_quantization": BASE_MODEL_QUANT,
    }
    assert list(config["quantization_config"])[:2] == ["activation_scheme", "fmt"]  # order kept
    assert config["topk_method"] == "noaux_tc" and "text_config" not in config
    assert config["rope_scaling"] == {"factor": 16}


def test_the_diff_shows_the_edits_and_the_original_is_kept(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=fork_route)
    original = (pack / "config.json").read_bytes()
    result = fix_config(pack)
    assert result.backup == pack / "config.json.bak"
    assert result.backup.read_bytes() == original
    assert '-    "non_routed_dtype_policy": "official_source_native",' in result.diff
    assert '+    "non_routed_dtype_policy": "bf16_as_stored",' in result.diff
    assert '+      "2": 3' in result.diff
    assert "model_type" not in result.diff  # same style as the file: only the edited lines change
    assert sorted(p.name for p in pack.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_a_second_run_changes_nothing_and_makes_no_backup(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=as_downloaded)
    fix_config(pack)
    fixed = (pack / "config.json").read_bytes()
    backup = (pack / "config.json.bak").stat()
    again = fix_config(pack)
    assert not again.changed and again.diff == "" and again.refused is None
    assert (pack / "config.json").read_bytes() == fixed
    assert (pack / "config.json.bak").stat().st_mtime_ns == backup.st_mtime_ns


def test_a_later_fix_never_overwrites_the_original(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=as_downloaded)
    original = (pack / "config.json").read_bytes()
    fix_config(pack)
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "fp8"
    (pack / "config.json").write_text(json.dumps(config, indent=2))
    assert fix_config(pack).changed
    assert (pack / "config.json.bak").read_bytes() == original


def test_a_healthy_pack_is_left_alone(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    result = fix_config(pack)
    assert not result.changed and result.backup is None
    assert not (pack / "config.json.bak").exists()


def test_the_write_keeps_the_mode_and_replaces_a_symlinked_config_without_touching_its_target(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=as_downloaded)
    blob = tmp_path / "blob-config.json"
    (pack / "config.json").rename(blob)
    blob.chmod(0o640)
    original = blob.read_bytes()
    (pack / "config.json").symlink_to(blob)
    assert fix_config(pack).changed
    config = pack / "config.json"
    assert not config.is_symlink() and stat.S_IMODE(config.stat().st_mode) == 0o640
    assert blob.read_bytes() == original == (pack / "config.json.bak").read_bytes()


def test_a_failed_write_leaves_the_config_as_it_was(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=as_downloaded)
    original = (pack / "config.json").read_bytes()

    def full_disk(step):
        if step == "replace:config.json":
            raise OSError(28, "No space left on device")

    with inject_faults(full_disk):
        result = fix_config(pack)
    assert result.refused == "config.json was not changed: No space left on device" and not result.changed
    assert (pack / "config.json").read_bytes() == original == (pack / "config.json.bak").read_bytes()
    assert sorted(p.name for p in pack.iterdir() if p.name.startswith(".")) == []


def test_a_backup_name_taken_by_something_else_stops_the_fix(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=as_downloaded)
    original = (pack / "config.json").read_bytes()
    (pack / "config.json.bak").mkdir()
    result = fix_config(pack)
    assert not result.changed and "config.json.bak exists and is not a regular file" in result.refused
    assert (pack / "config.json").read_bytes() == original


def fp8_declared(config: dict) -> None:
    config["quantization_config"]["quant_method"] = "fp8"


def mtp_overlay(shards) -> None:
    """Swap the source-format draft experts for EXL3 ones, as lna-lab's MTP overlay does."""
    for tensors in shards.values():
        for name in [n for n in tensors if n.startswith("mtp.") and ".ffn.experts." in n]:
            del tensors[name]
    shards["model-mtp-exl3.safetensors"] = {
        name: t for m in range(3) for name, t in routed_experts(SMALL, f"mtp.{m}", 2).items()
    }


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda path: build_lna_dense_pack(path, edit_config=fp8_declared), "dense-EXL3 pack (non_routed_exl3"),
        (
            lambda path: build_mixedk_pack(path, edit_tensors=mtp_overlay, edit_config=as_downloaded),
            "its MTP experts are EXL3 (.trellis)",
        ),
        (
            lambda path: (
                build_mixedk_pack(path, edit_config=as_downloaded),
                os.truncate(path / "model-00002-of-00006.safetensors", 10),
            )[0],
            "some shard headers cannot be read",
        ),
        (lambda path: (build_mixedk_pack(path), (path / "config.json").write_text("{oops"))[0], "is not valid JSON"),
    ],
    ids=["lna_dense", "mtp_exl3_overlay", "damaged_shard", "config_not_json"],
)
def test_packs_outside_the_recipe_are_refused_and_not_written(build, reason, tmp_path):
    pack = build(tmp_path / "pack")
    before = {p.name: p.read_bytes() for p in pack.iterdir() if p.is_file() and p.suffix == ".json"}
    result = fix_config(pack)
    assert reason in result.refused and "\n" not in result.refused
    assert not result.changed and result.backup is None
    assert {p.name: p.read_bytes() for p in pack.iterdir() if p.is_file() and p.suffix == ".json"} == before
    assert not (pack / "config.json.bak").exists()


def test_a_refused_pack_still_reports_its_failures(tmp_path):
    pack = build_lna_dense_pack(tmp_path / "pack", edit_config=fp8_declared)
    assert fix_config(pack).refused
    assert run_pack_checks(pack, "--tensor-parallel-size 8")["quant.method"].status == FAIL
