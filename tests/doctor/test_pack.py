"""The pack rows of doctor on synthetic packs: healthy packs pass, one mutation fails one row."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, WARN, DoctorContext
from patch_dsv4.doctor.readers.pack import pack_facts
from patch_dsv4.doctor.readers.safetensors import Shard, ShardError
from tests.doctor.synthetic import (
    DSPARK,
    FULL,
    MCG,
    Tensor,
    build_lna_dense_pack,
    build_mixedk_pack,
    fake_vllm,
    holder,
    run_pack_checks,
    shard_name,
    write_shard,
)

TP8 = "--tensor-parallel-size 8"


# ------------------------------------------------------------------ healthy packs


def test_the_mixedk_pack_passes_every_row(mixedk, stock_vllm):
    rows = run_pack_checks(mixedk(), DSPARK, stock_vllm)
    assert {r.id: r.status for r in rows.values() if r.status != PASS} == {}
    assert rows["experts.markers"].detail.startswith("all 48 EXL3 markers read")
    assert "4 main, 3 MTP" in rows["experts.complete"].detail


def test_the_lna_dense_pack_passes_every_row(lna, lna_vllm):
    rows = run_pack_checks(lna(), f"{TP8} {DSPARK}", lna_vllm)
    assert {r.id: r.status for r in rows.values() if r.status != PASS} == {}
    assert "8 slices" in rows["dense.wo-a-slices"].detail
    assert rows["mtp.format"].detail.startswith("MTP experts are exl3-format")


def test_the_full_size_mixedk_pack_passes_every_row(tmp_path, stock_vllm):
    pack = build_mixedk_pack(tmp_path / "full", FULL)
    rows = run_pack_checks(pack, DSPARK, stock_vllm)
    assert {r.id: r.status for r in rows.values() if r.status != PASS} == {}
    assert rows["pack.shards"].detail.startswith("48 shards, 101.43 GB")  # the real pack: 101.44 GB
    assert rows["experts.markers"].detail.startswith(f"all {43 * 256 * 3} EXL3 markers read")
    assert rows["quant.layer-bits"].detail.startswith(
        'bits 2 and layer_bits {"3": 3, "13": 3, "21": 3, "22": 3, "28": 3, "41": 3} match'
    )


def test_without_a_vllm_tree_the_rows_that_read_it_say_so(mixedk):
    rows = run_pack_checks(
        mixedk(edit_config=set_key("quantization_config", "non_routed_dtype_policy", value="official_source_native"))
    )
    assert rows["quant.delegate"].status == SKIP
    assert rows["quant.delegate"].detail == "no vLLM environment located"
    assert rows["dense.policy"].status == WARN
    assert "could not be checked: no vLLM environment located" in rows["dense.policy"].detail


def test_pack_facts(mixedk, lna):
    pack = mixedk()
    facts = pack_facts(DoctorContext(pack=pack))
    assert facts.vision and facts.index_topk == 192 and facts.num_attention_heads == 8
    assert facts.safetensors_bytes == sum(p.stat().st_size for p in pack.glob("*.safetensors"))
    assert (facts.attention_exl3, facts.shared_experts_exl3, facts.mtp_experts) == (False, False, "source")
    dense = pack_facts(DoctorContext(pack=lna()))
    assert (dense.attention_exl3, dense.shared_experts_exl3, dense.mtp_experts) == (True, True, "exl3")


def test_headers_are_read_once_per_run(mixedk, monkeypatch):
    pack = mixedk()
    opened = []
    real_enter = Shard.__enter__
    monkeypatch.setattr(Shard, "__enter__", lambda self: opened.append(self.path.name) or real_enter(self))
    run_pack_checks(pack)
    assert sorted(opened) == sorted(p.name for p in pack.glob("*.safetensors"))


# ------------------------------------------------------------------ mutations


def set_key(*path: str, value) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in path[:-1]:
            config = config[key]
        config[path[-1]] = value

    return edit


def del_key(*path: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in path[:-1]:
            config = config[key]
        del config[path[-1]]

    return edit


def change(name: str, **fields) -> Callable:
    def edit(shards) -> None:
        tensor = holder(shards, name)[name]
        for key, value in fields.items():
            setattr(tensor, key, value)

    return edit


def drop(name: str) -> Callable:
    return lambda shards: holder(shards, name).pop(name)


def truncate(file: str, by: int = 1000) -> Callable[[Path], None]:
    return lambda pack: os.truncate(pack / file, (pack / file).stat().st_size - by)


def index_without(file: str) -> Callable[[Path], None]:
    def edit(pack: Path) -> None:
        index = json.loads((pack / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
        (pack / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def index_naming(file: str) -> Callable[[Path], None]:
    def edit(pack: Path) -> None:
        index = json.loads((pack / "model.safetensors.index.json").read_text())
        index["weight_map"]["extra.weight"] = file
        (pack / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def dense_bits(bits: int) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for entry in config["quantization_config"]["non_routed_exl3"]["layers"].values():
            entry["bits"] = bits

    return edit


SHARD_2 = shard_name(2, 6)
EXPERT = "layers.1.ffn.experts.3"


@dataclass
class Case:
    row: str
    status: str
    detail: str
    fix: str
    pack: str = "mixedk"
    edit_config: Callable | None = None
    edit_tensors: Callable | None = None
    after: Callable[[Path], None] | None = None
    serve_args: str = ""
    vllm: dict | None = field(default_factory=dict)  # fake_vllm options; None: no vLLM located


CASES = {
    "quant_method_fp8": Case(
        "quant.method",
        FAIL,
        'quant_method is "fp8", not "exl3"',
        '"quant_method": "exl3"',
        edit_config=set_key("quantization_config", "quant_method", value="fp8"),
    ),
    "bits_absent": Case(
        "quant.bits",
        WARN,
        "has no bits; vllm-exl3 then assumes 4",
        "(the shards say 2)",
        edit_config=del_key("quantization_config", "bits"),
    ),
    "bits_out_of_range": Case(
        "quant.bits",
        FAIL,
        "bits is 7; vllm-exl3 accepts 2-6",
        'Set "bits"',
        edit_config=set_key("quantization_config", "bits", value=7),
    ),
    "codebook_mul1_with_mcg_markers": Case(
        "quant.codebook",
        FAIL,
        'codebook "mul1" does not match the pack: the routed experts carry .mcg',
        '"codebook": "mcg"',
        edit_config=set_key("quantization_config", "codebook", value="mul1"),
    ),
    "layer_bits_missing_k3_layer": Case(
        "quant.layer-bits",
        FAIL,
        "layer 2 declares K2, trellis width 48 means K3",
        '"layer_bits": {"2": 3}',
        edit_config=del_key("quantization_config", "layer_bits", "2"),
    ),
    "layer_bits_rejected_value": Case(
        "quant.layer-bits",
        FAIL,
        "layer_bits['2'] = 8 (vllm-exl3 accepts 2-6)",
        '"layer_bits": {"2": 3}',
        edit_config=set_key("quantization_config", "layer_bits", "2", value=8),
    ),
    "truncated_shard": Case(
        "pack.shards",
        FAIL,
        f"{SHARD_2}: is truncated",
        f"shard {SHARD_2} is incomplete (expected ",
        after=truncate(SHARD_2),
    ),
    "missing_numbered_shard": Case(
        "pack.shards",
        FAIL,
        f"{shard_name(3, 6)} is missing",
        "hf download <repo-id> --local-dir",
        after=lambda pack: (pack / shard_name(3, 6)).unlink(),
    ),
    "leftover_incomplete_download": Case(
        "pack.shards",
        FAIL,
        ".cache/huggingface/download/x.incomplete",
        "delete the leftover files",
        after=lambda pack: (
            (pack / ".cache/huggingface/download").mkdir(parents=True),
            (pack / ".cache/huggingface/download/x.incomplete").write_bytes(b""),
        ),
    ),
    "index_leaves_out_a_shard": Case(
        "pack.index",
        FAIL,
        "does not list model-mtp-exl3.safetensors",
        "vLLM will silently skip them",
        pack="lna",
        after=index_without("model-mtp-exl3.safetensors"),
        serve_args=TP8,
    ),
    "index_names_a_missing_shard": Case(
        "pack.index",
        FAIL,
        "names model-99999.safetensors, which is not in the pack",
        "Restore model-99999.safetensors",
        pack="lna",
        after=index_naming("model-99999.safetensors"),
        serve_args=TP8,
    ),
    "dangling_symlink": Case(
        "pack.symlinks",
        FAIL,
        "extra.safetensors is a symlink to a missing file",
        "copy the real file into the pack",
        after=lambda pack: (pack / "extra.safetensors").symlink_to(pack.parent / "gone.safetensors"),
    ),
    "symlink_out_of_the_pack": Case(
        "pack.symlinks",
        WARN,
        "tokenizer.json ->",
        "Copy the linked files into the pack",
        after=lambda pack: (
            (pack.parent / "tokenizer.json").write_text("{}"),
            (pack / "tokenizer.json").symlink_to(pack.parent / "tokenizer.json"),
        ),
    ),
    "missing_expert_tensor": Case(
        "experts.complete",
        FAIL,
        f"1 routed-expert tensor missing (first: {EXPERT}.w2.svh)",
        "Re-download the shards",
        edit_tensors=drop(f"{EXPERT}.w2.svh"),
    ),
    "missing_source_mtp_scale": Case(
        "experts.complete",
        FAIL,
        "(first: mtp.1.ffn.experts.0.w3.scale)",
        "Re-download",
        edit_tensors=drop("mtp.1.ffn.experts.0.w3.scale"),
    ),
    "scalar_mcg": Case(
        "experts.shapes",
        FAIL,
        f"{EXPERT}.w1.mcg is I32 [], expected I32 [1]",
        "Scalar MCG markers must be stored as [1]",
        edit_tensors=change(f"{EXPERT}.w1.mcg", shape=[]),
    ),
    "wrong_svh_size": Case(
        "experts.shapes",
        FAIL,
        f"{EXPERT}.w1.svh is F16 [64], expected F16 [32]",
        "vllm-exl3 destination",
        edit_tensors=change(f"{EXPERT}.w1.svh", shape=[64]),
    ),
    "tp_does_not_split_the_experts": Case(
        "experts.shapes",
        FAIL,
        "which --tensor-parallel-size 8 does not divide",
        "--tensor-parallel-size that divides 2",
        serve_args=TP8,
    ),
    "mixed_k_layer": Case(
        "experts.one-k",
        FAIL,
        "layer 1 mixes trellis widths [32, 48]",
        "one K per layer",
        edit_tensors=change(f"{EXPERT}.w2.trellis", shape=[2, 4, 48]),
    ),
    "wrong_marker_in_one_expert": Case(
        "experts.markers",
        FAIL,
        f"1 of 48 markers are wrong; first: {EXPERT}.w3.mcg holds 12345, not the MCG marker",
        "packed ABI does not match vllm-exl3",
        edit_tensors=change(f"{EXPERT}.w3.mcg", marker=12345),
    ),
    "wrong_marker_in_the_last_expert": Case(
        "experts.markers",
        FAIL,
        "first: layers.3.ffn.experts.3.w2.mcg holds 0, not the MCG marker",
        "packed ABI does not match",
        edit_tensors=change("layers.3.ffn.experts.3.w2.mcg", marker=0),
    ),
    "wrong_dense_marker": Case(
        "experts.markers",
        FAIL,
        "first: layers.3.attn.wo_a.slice.7.mcg holds -2082680531, not the MCG marker",
        "packed ABI does not match",
        pack="lna",
        serve_args=TP8,
        vllm={"lna_dense": True},
        edit_tensors=change("layers.3.attn.wo_a.slice.7.mcg", marker=-2082680531),
    ),
    "fork_policy_with_bf16_dense": Case(
        "dense.policy",
        FAIL,
        'non_routed_dtype_policy is "official_source_native" with 40 dense linears stored as BF16',
        '"non_routed_dtype_policy": "bf16_as_stored"',
        edit_config=set_key("quantization_config", "non_routed_dtype_policy", value="official_source_native"),
    ),
    "source_mtp_without_mtp_experts": Case(
        "mtp.format",
        FAIL,
        'MTP experts are source-format but mtp_experts is absent, not "source"',
        '"mtp_experts": "source", "mtp_experts_start_layer": 4',
        serve_args=DSPARK,
        edit_config=del_key("quantization_config", "mtp_experts"),
    ),
    "source_mtp_without_mtp_experts_no_dspark": Case(
        "mtp.format",
        WARN,
        "with --speculative-config dspark the draft load would fail after the target has loaded "
        "(KeyError: 'w13_weight_scale')",
        '"mtp_experts": "source"',
        edit_config=del_key("quantization_config", "mtp_experts"),
    ),
    "exl3_mtp_without_layer_bits": Case(
        "mtp.format",
        FAIL,
        "layer 5 (mtp.1) declares K4, its trellis is K2",
        'For this EXL3 draft, add {"5": 2} to "layer_bits".',
        pack="lna",
        serve_args=f"{TP8} {DSPARK}",
        vllm={"lna_dense": True},
        edit_config=lambda c: (c["quantization_config"].pop("bits"), c["quantization_config"]["layer_bits"].pop("5")),
    ),
    "exl3_mtp_declared_as_source": Case(
        "mtp.format",
        FAIL,
        'mtp_experts is "source", which sends EXL3 draft experts to the fp8 delegate',
        'For this EXL3 draft, remove "mtp_experts" and "mtp_experts_start_layer" from quantization_config.',
        pack="lna",
        serve_args=f"{TP8} {DSPARK}",
        vllm={"lna_dense": True},
        edit_config=set_key("quantization_config", "mtp_experts", value="source"),
    ),
    "unknown_delegate_method": Case(
        "quant.delegate",
        FAIL,
        'non_routed_quantization names "fp8_blockwise"',
        'Use "fp8"',
        edit_config=set_key("quantization_config", "non_routed_quantization", "quant_method", value="fp8_blockwise"),
    ),
    "wrong_non_routed_exl3_bits": Case(
        "dense.exl3-map",
        FAIL,
        "declares model.layers.0.attn.fused_wqa_wkv bits=4 but layers.0.attn.wkv.trellis",
        'non_routed_exl3 declares bits=4 where the trellis is K6: set every such "bits" to 6.',
        pack="lna",
        serve_args=TP8,
        vllm={"lna_dense": True},
        edit_config=dense_bits(4),
    ),
    "undeclared_dense_exl3": Case(
        "dense.exl3-map",
        FAIL,
        "layers.0.attn.wo_b is EXL3 but non_routed_exl3 does not declare",
        '{"bits": 6}',
        pack="lna",
        serve_args=TP8,
        vllm={"lna_dense": True},
        edit_config=del_key("quantization_config", "non_routed_exl3", "layers", "model.layers.0.attn.wo_b"),
    ),
    "wo_a_slices_at_tp1": Case(
        "dense.wo-a-slices",
        FAIL,
        "8 slices per layer but --tensor-parallel-size is 1",
        "serves only at --tensor-parallel-size 8 with recipe-lna/patch_dsv4_dense_exl3.py applied",
        pack="lna",
        vllm={"lna_dense": True},
    ),
    "wo_a_slices_without_the_lna_patch": Case(
        "dense.wo-a-slices",
        FAIL,
        "lack lna-lab's dense patch",
        "recipe-lna/patch_dsv4_dense_exl3.py",
        pack="lna",
        serve_args=TP8,
    ),
    "missing_topk_method": Case(
        "config.topk-method",
        FAIL,
        "routing biases on 3 layers (layers.1.ffn.gate.bias) but topk_method is absent",
        'Add "topk_method": "noaux_tc" at the top level',
        edit_config=del_key("topk_method"),
    ),
    "empty_text_config": Case(
        "pack.text-config",
        FAIL,
        'empty "text_config"',
        'Delete the "text_config" key',
        edit_config=set_key("text_config", value={}),
    ),
    "text_config_without_heads": Case(
        "pack.text-config",
        FAIL,
        "without num_attention_heads",
        "by hand",
        edit_config=set_key("text_config", value={"topk_method": "noaux_tc"}),
    ),
    "wrong_num_hash_layers": Case(
        "config.hash-layers",
        FAIL,
        "num_hash_layers is 3 but the checkpoint has tid2eid on 1 layer.",
        '"num_hash_layers": 1',
        edit_config=set_key("num_hash_layers", value=3),
    ),
    "vision_tensors_with_zero_vision_layers": Case(
        "config.vision",
        FAIL,
        "34 vision tensors (e.g. vision.blocks.0.norm1.weight) but vision_n_layers is 0",
        "Restore vision_n_layers from the source config",
        edit_config=set_key("vision_n_layers", value=0),
    ),
    "four_speculative_tokens_with_three_mtp_layers": Case(
        "config.spec-k",
        FAIL,
        "num_speculative_tokens is 4 and the pack has 3 MTP layers",
        "num_speculative_tokens=4 is not allowed with 3 MTP layers; use 3 (or a multiple of 3).",
        serve_args="""--speculative-config '{"method": "dspark", "num_speculative_tokens": 4}'""",
    ),
    "speculative_config_not_json": Case(
        "config.spec-k",
        FAIL,
        "--speculative-config is not JSON",
        "takes a JSON object",
        serve_args="--speculative-config '{method: dspark}'",
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_one_mutation_provokes_its_row(case: Case, tmp_path):
    build = build_lna_dense_pack if case.pack == "lna" else build_mixedk_pack
    pack = build(tmp_path / "pack", edit_config=case.edit_config, edit_tensors=case.edit_tensors)
    if case.after:
        case.after(pack)
    runtime = None if case.vllm is None else fake_vllm(tmp_path / "site", **case.vllm)
    row = run_pack_checks(pack, case.serve_args, runtime)[case.row]
    assert row.status == case.status, row
    assert case.detail in row.detail, row.detail
    assert case.fix in row.fix, row.fix


def test_the_fork_policy_passes_on_a_vllm_with_the_route_b_loader(mixedk, tmp_path):
    pack = mixedk(edit_config=set_key("quantization_config", "non_routed_dtype_policy", value="official_source_native"))
    row = run_pack_checks(pack, runtime=fake_vllm(tmp_path / "site", route_b=True))["dense.policy"]
    assert row.status == PASS and "_bf16_to_fp8_stream" in row.detail


def test_the_fork_policy_without_a_delegate_leaves_bf16_dense_weights_alone(mixedk, stock_vllm):
    def no_delegate(config):
        quant = config["quantization_config"]
        quant["non_routed_dtype_policy"] = "official_source_native"
        del quant["non_routed_quantization"]

    row = run_pack_checks(mixedk(edit_config=no_delegate), runtime=stock_vllm)["dense.policy"]
    assert row.status == PASS and "no non_routed_quantization delegate" in row.detail


def test_a_vision_pack_on_vllm_0_28_serves_text_only(mixedk, tmp_path):
    row = run_pack_checks(mixedk(), runtime=fake_vllm(tmp_path / "site", version="0.28.0"))["config.vision"]
    assert row.status == WARN and "loader-skips" in row.fix


def test_fix_texts_offer_fix_config_only_for_packs_it_edits(mixedk, lna):
    fp8 = set_key("quantization_config", "quant_method", value="fp8")
    mixedk_fix = run_pack_checks(mixedk(edit_config=fp8))["quant.method"].fix
    assert "--fix-config writes it" in mixedk_fix and "fix_pack_config.py" in mixedk_fix
    lna_fix = run_pack_checks(lna(edit_config=fp8), TP8)["quant.method"].fix
    assert "--fix-config" not in lna_fix and "fix_pack_config.py" not in lna_fix
    assert lna_fix.startswith('Set "quant_method": "exl3" in quantization_config by hand')


# ------------------------------------------------------------------ bad input: a row, never a traceback


def write_raw_shard(path: Path, header: bytes, payload: int = 0) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * payload)


BAD_SHARDS = {
    "header_length_past_the_end": (
        lambda p: p.write_bytes(struct.pack("<Q", 10**9) + b"{}"),
        "header length 1000000000 runs past the end of the file",
    ),
    "shorter_than_the_length_field": (
        lambda p: p.write_bytes(b"\1\2"),
        "is 2 bytes, shorter than the 8-byte header length",
    ),
    "header_not_utf8": (lambda p: write_raw_shard(p, b'{"\xff": 1}'), "header is not UTF-8"),
    "header_not_json": (lambda p: write_raw_shard(p, b'{"a": [1, 2'), "header is not JSON"),
    "header_not_an_object": (lambda p: write_raw_shard(p, b"[1, 2]"), "header is a JSON list, not an object"),
    "entry_not_an_object": (lambda p: write_raw_shard(p, b'{"a": 3}'), "tensor 'a' is described by a JSON int"),
    "unknown_dtype": (
        lambda p: write_raw_shard(p, b'{"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}', 2),
        "tensor 'a' has an unknown dtype 'Q4'",
    ),
    "size_not_dtype_times_shape": (
        lambda p: write_raw_shard(p, b'{"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 4]}}', 4),
        "tensor 'a' spans 4 bytes but F16 x [4] needs 8",
    ),
    "file_longer_than_its_header": (
        lambda p: write_raw_shard(p, b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}', 9),
        "is longer than its header says",
    ),
    "directory": (lambda p: p.mkdir(), "is not a regular file"),
    "fifo": (lambda p: os.mkfifo(p), "is not a regular file"),
    "symlink_loop": (lambda p: p.symlink_to(p.name), "cannot be opened (Too many levels of symbolic links)"),
}


@pytest.mark.parametrize("make, reason", BAD_SHARDS.values(), ids=BAD_SHARDS.keys())
def test_a_damaged_shard_is_a_fail_row_naming_it(make, reason, mixedk):
    pack = mixedk()
    make(pack / "model-extra.safetensors")
    rows = run_pack_checks(pack)
    assert rows["pack.shards"].status == FAIL
    assert f"model-extra.safetensors: {reason}" in rows["pack.shards"].detail


def test_a_hub_cache_snapshot_made_of_links_into_its_blobs_is_fine(tmp_path):
    repo = tmp_path / "models--vcruz305--pack"
    pack = build_mixedk_pack(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    (pack / "config.json").rename(repo / "blobs" / "f00d")
    (pack / "config.json").symlink_to("../../blobs/f00d")
    rows = run_pack_checks(pack)
    assert rows["pack.symlinks"].status == PASS and rows["pack.config"].status == PASS


def test_a_pack_directory_that_does_not_exist(tmp_path):
    rows = run_pack_checks(tmp_path / "nowhere")
    assert rows["pack.config"].status == FAIL and rows["pack.shards"].status == FAIL
    assert f"{tmp_path / 'nowhere'} cannot be listed" in rows["pack.shards"].detail
    assert {r: rows[r].status for r in rows if rows[r].status != SKIP} == {
        "pack.config": FAIL,
        "pack.shards": FAIL,
        "config.spec-k": PASS,
    }


def test_a_symlink_loop_also_fails_the_symlink_row(mixedk):
    pack = mixedk()
    (pack / "loop.safetensors").symlink_to("loop.safetensors")
    row = run_pack_checks(pack)["pack.symlinks"]
    assert row.status == FAIL and row.detail == "loop.safetensors is a symlink loop."


def test_a_shard_header_reads_no_payload_and_markers_read_four_bytes(tmp_path):
    path = tmp_path / "one.safetensors"
    write_shard(path, {"x.trellis": Tensor("I16", [256, 128, 48]), "x.mcg": Tensor("I32", [1], MCG)})
    with Shard(path) as shard:
        assert shard.tensors["x.trellis"]["shape"] == [256, 128, 48]
        assert shard.read_i32("x.mcg") == MCG
        assert shard.size_error is None
    os.truncate(path, 100)
    with pytest.raises(ShardError, match="header length .* runs past the end"):
        Shard(path).__enter__()


@pytest.mark.parametrize(
    "content",
    [None, b"{not json", b"[1, 2]", "fifo", "dir"],
    ids=["missing", "not_json", "not_an_object", "fifo", "directory"],
)
def test_a_bad_config_json_is_one_fail_row_and_the_rest_skip_or_read_headers(content, mixedk):
    pack = mixedk()
    config = pack / "config.json"
    config.unlink()
    if content == "fifo":
        os.mkfifo(config)
    elif content == "dir":
        config.mkdir()
    elif content is not None:
        config.write_bytes(content)
    rows = run_pack_checks(pack)
    assert rows["pack.config"].status == FAIL and str(config) in rows["pack.config"].detail
    assert "download the pack again" in rows["pack.config"].fix
    assert rows["quant.method"].status == SKIP and rows["pack.shards"].status == PASS


@pytest.mark.parametrize(
    "edit",
    [
        set_key("quantization_config", value=[1, 2]),
        set_key("quantization_config", "layer_bits", value=[3]),
        set_key("quantization_config", "non_routed_exl3", value="all"),
        set_key("quantization_config", "non_routed_quantization", value=7),
        set_key("num_hidden_layers", value="43"),
        set_key("num_hash_layers", value=None),
        set_key("vision_n_layers", value="lots"),
    ],
    ids=[
        "quant_list",
        "layer_bits_list",
        "non_routed_exl3_str",
        "delegate_int",
        "layers_str",
        "hash_null",
        "vision_str",
    ],
)
def test_odd_config_values_give_rows_not_tracebacks(edit, mixedk, stock_vllm):
    rows = run_pack_checks(mixedk(edit_config=edit), DSPARK, stock_vllm)
    assert any(r.status == FAIL for r in rows.values())


def test_an_unreadable_index_is_a_fail_row(lna):
    pack = lna()
    (pack / "model.safetensors.index.json").unlink()
    os.mkfifo(pack / "model.safetensors.index.json")
    row = run_pack_checks(pack, TP8)["pack.index"]
    assert row.status == FAIL and "not a regular file" in row.detail
