"""backbone.complete: every tensor vLLM creates outside the routed experts, on full-size synthetic packs (headers
only) cut as published packs were: on disk and from the stand-in Hub (tests/doctor/hub_server.py)."""

from __future__ import annotations

import re

import pytest

from patch_dsv4.doctor.readers.base import FAIL, PASS, WARN, DoctorContext, run_checks
from patch_dsv4.doctor.readers.hub import open_source
from patch_dsv4.doctor.readers.pack import pack_scan
from patch_dsv4.doctor.run import _read_hub_pack, pack_checks
from tests.doctor.hub_server import serving
from tests.doctor.synthetic import (
    FULL,
    SMALL_TP8,
    Tensor,
    build_lna_dense_pack,
    build_mixedk_pack,
    fake_vllm,
    run_pack_checks,
)
from tests.doctor.synthetic_v41 import FLASH, SMALL41, VARIANTS, build_v41_pack, build_v41_variant

ROUTED = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.")


def dropping(pattern: str):
    """An edit_tensors hook that removes every tensor whose name matches ``pattern`` (re.fullmatch)."""
    wanted = re.compile(pattern)

    def edit(shards):
        for tensors in shards.values():
            for name in [n for n in tensors if wanted.fullmatch(n)]:
                del tensors[name]

    return edit


def backbone(pack, serve_args: str = "", runtime=None):
    return run_pack_checks(pack, serve_args, runtime)["backbone.complete"]


# ------------------------------------------------------------------ the reported cases, full size


LAYERS_5_TO_39 = "|".join(str(n) for n in range(5, 40))


def test_v41_without_wq_b_and_wo_b_on_layers_5_to_39_fails(tmp_path):
    """Every layer still "carries attention" (v41.backbone passed it); 35 layers x 2 FP8 linears x 2 tensors."""
    pack = build_v41_pack(
        tmp_path / "pack",
        FLASH,
        edit_tensors=dropping(rf"layers\.({LAYERS_5_TO_39})\.attn\.(wq_b|wo_b)\.(weight|scale)"),
    )
    row = backbone(pack)
    assert row.status == FAIL
    assert row.detail.startswith(
        "[silent] 140 tensors vLLM creates are missing: attention 140 on layers 5-39 "
        "(first: layers.5.attn.wq_b.weight)."
    ), row.detail
    assert "Restore the missing tensors (attention) from the checkpoint the pack was made from" in row.fix


@pytest.mark.parametrize(
    "cut, expected",
    [
        (
            r"layers\.\d+\.ffn\.shared_experts\..*",
            "shared experts 129 on layers 0-42 (first: layers.0.ffn.shared_experts.w1.weight).",
        ),
        (
            r"layers\.\d+\.(hc_ffn_(fn|base|scale)|ffn_norm\.weight)",
            "hc_* 129 on layers 0-42 (first: layers.0.hc_ffn_fn); ffn_norm 43 on layers 0-42 "
            "(first: layers.0.ffn_norm.weight).",
        ),
        (
            r"layers\.(1\d|2\d)\.attn\.(wq_b|wo_b)\.weight",
            "attention 40 on layers 10-29 (first: layers.10.attn.wq_b.weight).",
        ),
    ],
    ids=["no-shared-experts", "no-hc_ffn-no-ffn_norm", "no-wq_b-wo_b-on-twenty-layers"],
)
def test_v4_mixedk_cut_as_reported_fails(tmp_path, cut, expected):
    """The MixedK pack this tool exists for had no backbone check at all: each cut was reported as nothing."""
    row = backbone(build_mixedk_pack(tmp_path / "pack", FULL, edit_tensors=dropping(cut)))
    assert row.status == FAIL and expected in row.detail, row.detail
    assert row.detail.startswith("[silent] ") and "fluent garbage" in row.detail


def test_the_vcruz305_pack_without_its_backbone_is_counted_as_its_issue_13_says(tmp_path):
    """DSV4.1-Flash-EXL3-4.75bpw at e971fd55: of the base's 1,621 non-routed tensors, 603 of attention, 240 of
    shared experts, 240 hc_*, 120 of the gates and 40 ffn_norm missing (Blackwellboy's recipe,
    docs/QUALITY_MISSING_ATTN_WEIGHTS.md @186513f)."""
    good = build_v41_pack(tmp_path / "good", FLASH)
    assert len(pack_scan(DoctorContext(pack=good)).others) == 1621  # the base's non-routed tensors, as the doc counts
    row = backbone(build_v41_variant(tmp_path / "broken", "no-backbone"))
    assert row.status == FAIL
    assert row.detail.startswith(
        "[silent] 1,243 tensors vLLM creates are missing: attention 603 on layers 0-39 (first: "
        "layers.0.attn_norm.weight); shared experts 240 on layers 0-39 (first: layers.0.ffn.shared_experts.w1.weight); "
        "hc_* 240 on layers 0-39 (first: layers.0.hc_attn_fn); gates 120 on layers 0-39 (first: "
        "layers.0.ffn.gate.weight); ffn_norm 40 on layers 0-39 (first: layers.0.ffn_norm.weight). "
    ), row.detail
    assert "Restore the missing tensors (attention, shared experts, hc_*, gates, ffn_norm)" in row.fix
    assert "fix_missing_backbone.py" in row.fix


# ------------------------------------------------------------------ no false fail


@pytest.mark.parametrize(
    "build",
    [
        lambda d: build_mixedk_pack(d),
        lambda d: build_mixedk_pack(d, FULL),
        lambda d: build_lna_dense_pack(d),
        *(lambda d, v=v: build_v41_variant(d, v, SMALL41) for v in sorted(VARIANTS) if v != "no-backbone"),
        lambda d: build_v41_pack(d, FLASH),
        lambda d: build_v41_pack(d, FLASH, kind="dense"),
    ],
    ids=[
        "mixedk",
        "mixedk-full",
        "lna-dense",
        *(v for v in sorted(VARIANTS) if v != "no-backbone"),
        "v41-full",
        "v41-dense-full",
    ],
)
def test_every_complete_synthetic_pack_passes(tmp_path, build):
    row = backbone(build(tmp_path / "pack"))
    assert row.status == PASS, row
    assert row.detail.startswith("all ") and "the top level" in row.detail


def test_a_complete_pack_on_a_release_without_vision_classes_needs_no_vision_gates(tmp_path):
    """0.28/0.29 create no bias_vl (and no gate bias on hash layers): a vision pack without them is complete there,
    and incomplete from 0.30.0 on (V0.28.0 nvidia/model.py:581-600; V0.30.0 :846-878)."""
    pack = build_mixedk_pack(tmp_path / "pack", edit_tensors=dropping(r".*\.ffn\.gate\.bias_vl"))
    assert backbone(pack, runtime=fake_vllm(tmp_path / "028", version="0.28.0")).status == PASS
    row = backbone(pack, runtime=fake_vllm(tmp_path / "030", version="0.30.0"))
    assert row.status == FAIL and "gates 4 on layers 0-3 (first: layers.0.ffn.gate.bias_vl)" in row.detail


# ------------------------------------------------------------------ forms, kinds, the draft, the fix


def test_an_fp8_linear_without_its_scale_is_missing_its_scale(tmp_path):
    pack = build_v41_pack(tmp_path / "pack", SMALL41, edit_tensors=dropping(r"layers\.2\.attn\.wq_b\.scale"))
    row = backbone(pack)
    assert row.status == FAIL and "1 tensor vLLM creates is missing: attention 1 on layer 2" in row.detail
    assert "(first: layers.2.attn.wq_b.scale)" in row.detail


def test_a_wo_a_stored_in_slices_is_met_by_all_of_them(tmp_path):
    pack = build_lna_dense_pack(
        tmp_path / "pack", SMALL_TP8, edit_tensors=dropping(r"layers\.1\.attn\.wo_a\.slice\.3\..*")
    )
    row = backbone(pack)
    assert row.status == FAIL and "attention 4 on layer 1 (first: layers.1.attn.wo_a.slice.3.trellis)" in row.detail


def test_a_linear_absent_altogether_is_counted_in_the_form_its_kind_is_stored_in(tmp_path):
    """EXL3 in a dense-EXL3 pack: trellis, suh, svh and the marker."""
    pack = build_v41_pack(tmp_path / "pack", SMALL41, kind="dense", edit_tensors=dropping(r"layers\.3\.attn\.wkv\..*"))
    row = backbone(pack)
    assert row.status == FAIL and "attention 4 on layer 3 (first: layers.3.attn.wkv.trellis)" in row.detail


def test_a_name_the_other_layers_of_its_kind_carry_is_named(tmp_path):
    """V4.1-Flash's 29 layers that are no kv, index or Engram layer are of one kind (the same inventory): one of them
    lacks a tensor the others carry, which vLLM as doctor reads it has no parameter for."""

    def odd(shards):
        for layer in range(FLASH.layers):
            if layer != 22:
                next(iter(shards.values()))[f"layers.{layer}.attn.extra_gain"] = Tensor("F32", [64])

    row = backbone(build_v41_pack(tmp_path / "pack", FLASH, edit_tensors=odd))
    assert row.status == WARN and "layers.22.attn.extra_gain is missing where the other layers" in row.detail
    assert "(and " not in row.detail.split(" is missing")[0]  # that layer alone

    def one_extra(shards):  # one layer's extra tensor is no gap in the 28 others
        next(iter(shards.values()))["layers.21.attn.extra_gain"] = Tensor("F32", [64])

    assert backbone(build_v41_pack(tmp_path / "one", FLASH, edit_tensors=one_extra)).status == PASS


def test_the_draft_alone_missing_a_tensor_is_a_warning(tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack", edit_tensors=dropping(r"mtp\.1\.attn\.wq_b\.weight"))
    row = backbone(pack)
    assert (
        row.status == WARN
        and "the draft lacks 1 tensor: draft 1 on stage 1 (first: mtp.1.attn.wq_b.weight)" in row.detail
    )
    # the fix fits the serve line: no draft asked for, nothing to drop
    assert row.fix.endswith("It matters only with --speculative-config, which the serve line does not give."), row.fix
    drafting = backbone(pack, """--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'""")
    assert drafting.status == WARN and drafting.fix.endswith("Or serve without --speculative-config."), drafting.fix


def test_a_partial_vision_tower_fails_unless_images_are_off(tmp_path):
    pack = build_v41_pack(tmp_path / "pack", SMALL41, edit_tensors=dropping(r"vision\.blocks\.1\..*"))
    row = backbone(pack)
    assert row.status == FAIL and "vision tower 8 (first: vision.blocks.1.norm1.weight)" in row.detail
    row = backbone(pack, "--language-model-only")
    assert row.status == PASS and "the serve line turns images off" in row.detail


def test_the_fix_names_the_base_the_config_names(tmp_path):
    def named(config):
        config["_name_or_path"] = "deepseek-ai/DeepSeek-V4.1-Flash"

    pack = build_v41_pack(tmp_path / "pack", SMALL41, edit_config=named, edit_tensors=dropping(r"layers\.0\.hc_.*"))
    row = backbone(pack)
    assert row.status == FAIL and "from deepseek-ai/DeepSeek-V4.1-Flash, the checkpoint config.json names" in row.fix


# ------------------------------------------------------------------ from the Hub


REPO = "vcruz305/DSV4.1-Flash-EXL3-4.75bpw"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return monkeypatch


def hub_row(hub_env, pack):
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        ctx = DoctorContext(pack=open_source(f"hf://{REPO}"))
        _read_hub_pack(ctx)
        rows = {row.id: row for row in run_checks(ctx, pack_checks())}
    return rows["backbone.complete"]


@pytest.mark.parametrize(
    "build, status",
    [
        (lambda d: build_v41_variant(d, "no-backbone"), FAIL),
        (
            lambda d: build_v41_pack(
                d, FLASH, edit_tensors=dropping(rf"layers\.({LAYERS_5_TO_39})\.attn\.(wq_b|wo_b)\..*")
            ),
            FAIL,
        ),
        (lambda d: build_mixedk_pack(d, FULL, edit_tensors=dropping(r"layers\.\d+\.ffn\.shared_experts\..*")), FAIL),
        (lambda d: build_v41_pack(d, FLASH), PASS),
    ],
    ids=["v41-no-backbone", "v41-no-wq_b-wo_b", "mixedk-no-shared-experts", "v41-complete"],
)
def test_a_pack_on_the_hub_is_judged_as_on_disk(hub_env, tmp_path, build, status):
    """The same headers, read by range requests (the MixedK pack has no index: its shards are listed)."""
    pack = build(tmp_path / "pack")
    local = backbone(pack)
    remote = hub_row(hub_env, pack)
    assert local.status == status
    assert (remote.status, remote.detail, remote.fix) == (local.status, local.detail, local.fix)


def test_a_config_of_a_hundred_thousand_layers_is_not_listed_tensor_by_tensor(tmp_path):
    def huge(config):
        config["num_hidden_layers"] = 100_000
        config["compress_ratios"] = [0] * 100_003

    row = backbone(build_mixedk_pack(tmp_path / "pack", edit_config=huge))
    assert row.status == "skip" and "declares 100,000 layers, more than doctor lists" in row.detail
