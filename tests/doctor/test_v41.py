"""doctor on DeepSeek-V4.1 packs (v41-packs.md §1-§4): recognised from config.json, read through the nested
config as vLLM flattens it, judged by the V4.1 rows and by none of the V4 rows that would misfire.

Full-size packs (synthetic_v41.FLASH: 48 shards, 188k tensors, 188.8 GiB of Engram tables as headers) where
figures matter; SMALL41 elsewhere, whose numbers all differ from V4.1-Flash's, so a row that took a constant
instead of the pack's config would fail on it.
"""

from __future__ import annotations

import json
import platform
from dataclasses import replace
from pathlib import Path

import pytest

from patch_dsv4.doctor.checks.v41_config import v41_config_edits
from patch_dsv4.doctor.fix_config import fix_config
from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, CheckSpec, DoctorContext, Runtime, run_checks
from patch_dsv4.doctor.readers.family import V4, V41, family_of, flatten_v41
from patch_dsv4.doctor.run import CHECKS, _register_checks
from tests.conftest import run_cli
from tests.doctor import pip_index
from tests.doctor.fake_runtime import (
    install_exllamav3,
    install_flashinfer,
    install_plugin,
    install_torch,
    nvidia_smi,
    toolchain,
    write_meminfo,
)
from tests.doctor.synthetic import PACK_CHECKS, build_mixedk_pack, fake_vllm, run_pack_checks
from tests.doctor.synthetic_v41 import SMALL41, VARIANTS, build_v41_pack, build_v41_variant, v41_config
from tests.releases import pristine_tree

GIB = 2**30


def all_rows(pack: Path, serve_args: str = "", runtime: Runtime | None = None, environ=None, proc=None) -> dict:
    """Every row of every check (pack, runtime, environment, host) by id, the first of each id."""
    _register_checks()
    ctx = DoctorContext.from_serve_args(
        serve_args,
        pack=pack,
        runtime=runtime,
        environ={"PATH": ""} if environ is None else environ,
        proc_root=proc or Path("/nonexistent-proc"),
    )
    rows = run_checks(ctx, CHECKS)
    crashed = [r for r in rows if r.detail.startswith("internal error")]
    assert not crashed, crashed
    found = {}
    for row in rows:
        found.setdefault(row.id, row)
    return found


def v41_ids() -> list[str]:
    _register_checks()
    return [spec.id for spec in CHECKS if spec.family == V41]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """The full-size routed-only V4.1-Flash pack (built once: ~1 s, ~33 MB)."""
    return build_v41_pack(tmp_path_factory.mktemp("flash") / "pack")


@pytest.fixture(scope="module")
def flash_dense(tmp_path_factory):
    return build_v41_variant(tmp_path_factory.mktemp("flash-dense") / "pack", "dense-exl3")


@pytest.fixture
def small(tmp_path):
    return lambda name="good", **kw: (
        build_v41_pack(tmp_path / name, SMALL41, **kw) if kw else build_v41_variant(tmp_path / name, name, SMALL41)
    )


# ------------------------------------------------------------------ recognition and flattening


def test_the_family_comes_from_model_type_or_architectures():
    config = v41_config(SMALL41)
    assert DoctorContext(pack=None).pack_family() is None
    config["quantization_config"]["expert_dtype"] = "fp4"
    flat = flatten_v41(config)
    assert flat["num_hidden_layers"] == SMALL41.layers and flat["vision_n_layers"] == SMALL41.vision_layers
    assert flat["expert_dtype"] == "fp4" and flat["model_type"] == "deepseek_v41"  # text_config's is not copied
    assert "text_config" not in flat and "vision_config" not in flat
    assert family_of({"model_type": "deepseek_v4"}) == V4
    assert family_of({"architectures": ["DeepseekV41ForCausalLM"]}) == V41


def v4_only_ids() -> set[str]:
    """The checks registered for V4 packs only (each says so at its @check)."""
    _register_checks()
    return {spec.id for spec in CHECKS if spec.family == V4}


def test_the_rows_that_would_misread_a_v41_pack_are_registered_for_v4_packs_only():
    """Where a check is registered is the one place its family is said: these V4 rows read numbers a V4.1
    pack keeps elsewhere (v41-packs.md §1.1) and must not run on one."""
    assert {
        "pack.text-config",
        "quant.layer-bits",
        "experts.complete",
        "dense.policy",
        "config.topk-method",
        "config.vision",
        "rt.flashinfer",
        "host.kv-budget",
    } <= v4_only_ids()
    assert all(spec.family in (None, V4, V41) for spec in CHECKS)


def test_a_good_full_size_v41_pack_passes_every_pack_row(flash):
    ctx = DoctorContext(pack=flash)
    assert ctx.pack_family() == V41
    rows = run_pack_checks(flash)
    assert not set(rows) & v4_only_ids()
    assert {"v41.config", "v41.engram-tables", "backbone.complete", "v41.experts", "v41.pack-kind"} <= set(rows)
    assert all(row.status == PASS for row in rows.values()), [r for r in rows.values() if r.status != PASS]
    assert "40 layers, hidden 5120, 384 experts top-6, Engram on layers [1, 14]" in rows["v41.config"].detail
    assert "188.8 GiB" in rows["v41.engram-tables"].detail and "prime layout agrees" in rows["v41.engram-tables"].detail
    assert rows["v41.pack-kind"].detail.startswith("routed-only EXL3")


def test_a_good_pack_of_other_numbers_passes_too(small):
    """SMALL41 shares no number with V4.1-Flash (layers, widths, experts, Engram layers and rows, draft):
    the rows read the pack's own config (as they must for V4.1-Flash-1017's unseen one)."""
    rows = run_pack_checks(small())
    assert all(row.status == PASS for row in rows.values()), [r for r in rows.values() if r.status != PASS]
    assert "4 layers, hidden 256, 8 experts" in rows["v41.config"].detail


def test_v4_packs_get_no_v41_row_and_their_rows_unchanged(tmp_path):
    pack = build_mixedk_pack(tmp_path / "v4")
    assert DoctorContext(pack=pack).pack_family() == V4
    rows = run_pack_checks(pack)
    assert not [r for r in rows if r.startswith("v41.")]
    assert list(rows) == [spec.id for spec in PACK_CHECKS if spec.family != V41]


def test_a_good_v41_pack_gets_no_false_fail_from_the_whole_report(flash):
    """Every row (runtime, environment, host included) on a bare environment: the V4.1 rows pass or say
    what they could not decide; no V4 row that would misread V4.1 runs."""
    rows = all_rows(flash, "-tp 4 --language-model-only")
    assert not set(rows) & v4_only_ids()
    v41 = {i: rows[i] for i in v41_ids() if i in rows}
    assert all(r.status in (PASS, INFO, WARN, SKIP) for r in v41.values()), v41
    assert rows["v41.indexer-topk"].status == INFO and "could not tell the GPU" in rows["v41.indexer-topk"].detail


# ------------------------------------------------------------------ the failing variants


@pytest.mark.parametrize(
    "variant, row, status, text",
    [
        ("no-engram", "v41.engram-tables", FAIL, "[silent] the pack has no Engram table for 1 layer"),
        ("no-backbone", "backbone.complete", FAIL, "[silent] 135 tensors vLLM creates are missing: attention 71"),
        ("engram-shape", "v41.engram-tables", FAIL, "[1201053, 64], the config"),
        ("flat-config", "v41.config", FAIL, "config.json is flat (no text_config)"),
        ("mismatched-type", "v41.config", FAIL, '"deepseek_v41" and architectures ["DeepseekV4ForCausalLM"]'),
        ("text-only", "v41.vision", WARN, "no vision tower"),
        ("dense-exl3", "v41.pack-kind", INFO, "dense EXL3"),
    ],
)
def test_each_failing_variant_fails_its_row_with_the_message(small, variant, row, status, text):
    rows = run_pack_checks(small(variant))
    assert rows[row].status == status and text in rows[row].detail, rows[row]
    if status in (WARN, FAIL):
        assert rows[row].fix


def test_variants_list_is_what_the_tests_cover():
    assert set(VARIANTS) == {
        "good",
        "no-engram",
        "no-backbone",
        "engram-shape",
        "dense-exl3",
        "mia",
        "text-only",
        "flat-config",
        "mismatched-type",
    }


def test_the_missing_tables_fix_names_the_shards_and_the_index(flash, tmp_path):
    pack = build_v41_variant(tmp_path / "mia", "mia")
    rows = run_pack_checks(pack)
    tables = rows["v41.engram-tables"]
    assert tables.status == FAIL and "layers.1.engram.embed.{weight,scale}, layers.14" in tables.detail
    assert "188.8 GiB" in tables.detail and "model.safetensors.index.json" in tables.fix


def test_a_dense_pack_on_stock_vllm_fails_and_serves_with_an_in_tree_exl3(tmp_path, small):
    pack = small("dense-exl3")
    stock = fake_vllm(tmp_path / "stock", version="0.34.0")
    assert run_pack_checks(pack, runtime=stock)["v41.pack-kind"].status == FAIL
    mia = fake_vllm(tmp_path / "mia", version="0.34.0")
    exl3 = mia.vllm_root / "vllm/model_executor/layers/quantization/exl3.py"
    exl3.write_text("class Exl3Config: ...\n")
    assert run_pack_checks(pack, runtime=mia)["v41.pack-kind"].status == PASS


def test_the_prime_layout_and_a_kit_table_dir_are_checked(small):
    def wrong_vocab(config):
        config["text_config"]["engram_vocab_size"] += 1000

    rows = run_pack_checks(small("vocab", edit_config=wrong_vocab))
    assert rows["v41.engram-tables"].status == FAIL and "prime layout" in rows["v41.engram-tables"].detail

    def table_dir(config):
        config["text_config"]["engram_table_dir"] = "/models/engram"

    rows = run_pack_checks(small("dir", edit_config=table_dir))
    assert rows["v41.engram-tables"].status == WARN and "engram_table_dir" in rows["v41.engram-tables"].detail


def test_a_v4_style_delegate_fails_and_fix_config_writes_v41s_inside_the_nested_config(small):
    def v4_delegate(config):
        quant = config["quantization_config"]
        quant["non_routed_quantization"]["weight_block_size"] = [128, 128]
        del quant["mtp_experts"]
        config["text_config"]["topk_method"] = "greedy"

    pack = small("v4-delegate", edit_config=v4_delegate)
    rows = run_pack_checks(pack)
    assert rows["v41.delegate"].status == FAIL and "[32, 32]" in rows["v41.delegate"].detail
    assert rows["v41.config"].status == FAIL and "noaux_tc" in rows["v41.config"].detail
    edits = v41_config_edits(DoctorContext(pack=pack))
    assert {e.path for e in edits} == {
        ("quantization_config", "non_routed_quantization"),
        ("quantization_config", "mtp_experts"),
        ("text_config", "topk_method"),
    }
    result = fix_config(pack)
    assert result.changed and result.refused is None
    written = json.loads((pack / "config.json").read_text())
    assert written["text_config"]["topk_method"] == "noaux_tc"
    assert written["quantization_config"]["non_routed_quantization"]["weight_block_size"] == [32, 32]
    assert "num_hidden_layers" not in written and "topk_method" not in written  # nothing flattened into the top
    assert all(row.status == PASS for row in run_pack_checks(pack).values())
    assert not fix_config(pack).changed


def test_fix_config_refuses_a_v41_config_whose_layout_is_wrong(small):
    pack = small("flat-config")
    before = (pack / "config.json").read_text()
    result = fix_config(pack)
    assert result.refused and "not laid out as a V4.1 config" in result.refused
    assert (pack / "config.json").read_text() == before


# ------------------------------------------------------------------ serving rows


def test_the_ep_filter_with_dspark_starves_the_draft(small):
    spec = """--speculative-config '{"method": "dspark"}'"""
    rows = run_pack_checks(small(), f"-tp 2 --enable-expert-parallel --enable-ep-weight-filter {spec}")
    row = all_rows(small(), f"-tp 2 --enable-expert-parallel --enable-ep-weight-filter {spec}")["v41.ep-filter-draft"]
    assert (
        rows
        and row.status == WARN
        and "EP rank 1 never loads its draft experts" in row.detail
        and "8 experts" in row.detail
    )
    dotted = all_rows(small(), "-tp 2 -dp 2 -ep --enable-ep-weight-filter --speculative-config.method dspark")
    assert (
        dotted["v41.ep-filter-draft"].status == WARN
        and "EP ranks 1-3 never load" in dotted["v41.ep-filter-draft"].detail
    )
    assert all_rows(small(), f"-tp 2 -ep {spec}")["v41.ep-filter-draft"].status == PASS


def test_draft_quant_fields_in_a_dict_hf_overrides_fail(small):
    def strip(config):
        del config["quantization_config"]["mtp_experts"]

    pack = small("strip", edit_config=strip)
    overrides = """--hf-overrides '{"quantization_config": {"mtp_experts": "source"}}'"""
    spec = """--speculative-config '{"method": "dspark"}'"""
    row = all_rows(pack, f"{overrides} {spec}")["v41.draft-overrides"]
    assert row.status == FAIL and "lacks mtp_experts" in row.detail and '"mtp_experts": "source"' in row.fix
    assert all_rows(pack, overrides)["v41.draft-overrides"].status == PASS  # no draft, no miss
    dotted = "--hf-overrides.quantization_config.mtp_experts source --speculative-config.method dspark"
    assert all_rows(pack, dotted)["v41.draft-overrides"].status == FAIL


@pytest.mark.parametrize(
    "args, text",
    [
        ("-tp 3", "--tensor-parallel-size 3 does not split 8 attention heads"),
        ("-tp 2 --enable-dbo", "--enable-dbo/--ubatch-size above 1 are refused"),
        ("-tp 2 --ubatch-size 2", "--enable-dbo/--ubatch-size above 1 are refused"),
        ("""--speculative-config '{"method": "mtp"}'""", 'method "mtp" is refused'),
    ],
)
def test_the_topology_vllm_refuses_fails(small, args, text):
    row = all_rows(small(), args)["v41.topology"]
    assert row.status == FAIL and text in row.detail


def test_a_ubatch_size_of_one_or_zero_is_no_microbatching(small):
    assert all_rows(small(), "-tp 2 --ubatch-size 0")["v41.topology"].status == PASS
    assert all_rows(small(), "-tp 2 --ubatch-size 1")["v41.topology"].status == PASS


def test_the_indexer_topk_row_reads_the_gpu(small, tmp_path):
    pack = small()
    bare = all_rows(pack)["v41.indexer-topk"]
    assert bare.status == INFO and "could not tell the GPU" in bare.detail
    gb10 = tmp_path / "gb10"
    nvidia_smi(gb10, [("NVIDIA GB10", "12.1", "[N/A]")])
    row = all_rows(pack, environ={"PATH": str(gb10)})["v41.indexer-topk"]
    assert row.status == WARN and "per_row" in row.fix
    assert (
        all_rows(pack, "--sparse-indexer-topk-backend per_row", environ={"PATH": str(gb10)})["v41.indexer-topk"].status
        == PASS
    )
    hopper = tmp_path / "h200"
    nvidia_smi(hopper, [("NVIDIA H200", "9.0", "143771")])
    assert all_rows(pack, environ={"PATH": str(hopper)})["v41.indexer-topk"].status == PASS


def test_exl3_shared_experts_and_compressor_need_the_stream_switches(small, tmp_path):
    pack = small("dense-exl3")
    runtime = fake_vllm(tmp_path / "site", version="0.34.0")
    rows = all_rows(pack, runtime=runtime)
    assert (
        rows["v41.shared-stream"].status == FAIL
        and "VLLM_DISABLE_SHARED_EXPERTS_STREAM" in rows["v41.shared-stream"].fix
    )
    assert rows["v41.aux-streams"].status == FAIL and "attn.compressor" in rows["v41.aux-streams"].detail
    on = {"PATH": "", "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1", "PATCH_DSV4_AUX_STREAMS": "0"}
    applied = replace(runtime, patch_verdicts={"aux-streams": "applied"})
    rows = all_rows(pack, runtime=applied, environ=on)
    assert rows["v41.shared-stream"].status == PASS and rows["v41.aux-streams"].status == PASS
    threshold = all_rows(pack, runtime=runtime, environ={"PATH": "", "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD": "0"})
    assert threshold["v41.aux-streams"].status == PASS
    routed = all_rows(small(), runtime=runtime)
    assert routed["v41.shared-stream"].status == PASS and routed["v41.aux-streams"].status == PASS


def _dist(site: Path, name: str, version: str, requires: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")


def test_flashinfer_against_vllms_pin_and_a_jit_cache_of_another_version(small, tmp_path, monkeypatch):
    pip_index.serve(monkeypatch, tmp_path, ["0.7.2.post1", "0.7.3", "0.7.4"])
    pack = small()
    site = tmp_path / "site"
    runtime = fake_vllm(site, version="0.34.0")
    _dist(site, "vllm", "0.34.0", "Requires-Dist: flashinfer-python==0.7.3\n")
    _dist(site, "flashinfer-python", "0.7.3")
    assert all_rows(pack, runtime=runtime)["v41.flashinfer"].status == PASS
    _dist(site, "flashinfer-jit-cache", "0.7.2.post1")
    row = all_rows(pack, runtime=runtime)["v41.flashinfer"]
    assert row.status == WARN and "flashinfer-jit-cache 0.7.2.post1 beside flashinfer-python 0.7.3" in row.detail
    # --site-packages DIR: pip will not uninstall from a directory of its own; the files its RECORD lists go
    cache = site / "flashinfer_jit_cache-0.7.2.post1.dist-info"
    assert row.fix == f"rm -r {cache} (or install them at 0.7.3)"
    as_python = replace(runtime, target_args=" --python /opt/venv/bin/python")
    row = all_rows(pack, runtime=as_python)["v41.flashinfer"]
    assert row.fix == "/opt/venv/bin/python -m pip uninstall -y flashinfer-jit-cache (or install them at 0.7.3)"
    for old in site.glob("flashinfer_*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    _dist(site, "flashinfer-python", "0.7.4")
    row = all_rows(pack, runtime=runtime)["v41.flashinfer"]
    assert row.status == WARN and "pins flashinfer-python==0.7.3; 0.7.4 is installed" in row.detail
    assert row.fix == f"pip install --no-deps --upgrade --target {site} flashinfer-python==0.7.3"


def test_flashinfer_nearest_the_pin_pips_index_serves_is_no_skew(small, tmp_path, monkeypatch):
    """vLLM 0.34.0 pins 0.7.3, which pip's index does not serve (0.7.2.post1 and 0.7.4): 0.7.4 installed is what
    a user can have, said as such; absent, the fix names 0.7.4 and says why, never the unserved 0.7.3."""
    pip_index.serve(monkeypatch, tmp_path, ["0.7.2.post1", "0.7.4"])
    pack = small()
    site = tmp_path / "site"
    runtime = fake_vllm(site, version="0.34.0")
    _dist(site, "vllm", "0.34.0", "Requires-Dist: flashinfer-python==0.7.3\n")
    _dist(site, "flashinfer-python", "0.7.4")
    row = all_rows(pack, runtime=runtime)["v41.flashinfer"]
    assert row.status == PASS
    assert "(vLLM pins 0.7.3, which pip's index does not serve; 0.7.4 is the nearest above it)" in row.detail
    for f in (site / "flashinfer_python-0.7.4.dist-info").iterdir():
        f.unlink()
    (site / "flashinfer_python-0.7.4.dist-info").rmdir()
    row = all_rows(pack, runtime=runtime)["v41.flashinfer"]
    assert row.fix == (
        f"pip install --no-deps --upgrade --target {site} flashinfer-python==0.7.4 "
        "(0.7.3 is not on pip's index; 0.7.4 is the nearest above it that it serves)"
    )


# ------------------------------------------------------------------ Engram capacity


def _host(tmp_path: Path, gpu: tuple[str, str, str], count: int, total_gib: float) -> tuple[dict, Path]:
    tools = tmp_path / f"tools-{gpu[0].replace(' ', '')}-{count}"
    nvidia_smi(tools, [gpu] * count)
    proc = tmp_path / f"proc-{total_gib}"
    kb = int(total_gib * GIB / 1024)
    write_meminfo(proc, kb, kb - (1 << 20), 0)
    return {"PATH": str(tools)}, proc


GB10 = ("NVIDIA GB10", "12.1", "[N/A]")
H200 = ("NVIDIA H200", "9.0", "143771")


def test_engram_tables_on_a_gb10_at_tp2_fail_with_the_figures(flash, tmp_path):
    environ, proc = _host(tmp_path, GB10, 1, 121.69)
    row = all_rows(flash, "-tp 2", environ=environ, proc=proc)["v41.engram-capacity"]
    assert row.status == FAIL, row
    assert "132.0 GiB of Engram tables" in row.detail and "94.4 GiB exact" in row.detail
    assert "188.8 GiB in all" in row.detail and "disk-backed Engram" in row.fix


def test_engram_tables_at_tp8_fit_a_big_discrete_host_and_not_a_small_one(flash, tmp_path):
    environ, proc = _host(tmp_path, H200, 8, 2048)
    row = all_rows(flash, "-tp 8", environ=environ, proc=proc)["v41.engram-capacity"]
    assert row.status == PASS and "264.0 GiB of host RAM" in row.detail
    environ, proc = _host(tmp_path, H200, 8, 256)
    row = all_rows(flash, "-tp 8", environ=environ, proc=proc)["v41.engram-capacity"]
    assert row.status == FAIL and "does not fit" in row.detail
    thp = """--engram-config '{"use_thp": true}'"""
    row = all_rows(flash, f"-tp 8 {thp}", environ=environ, proc=proc)["v41.engram-capacity"]
    assert row.status == PASS and "exact with use_thp" in row.detail


def test_without_a_gpu_the_capacity_row_says_what_it_could_not_decide(flash):
    row = all_rows(flash, "-tp 2")["v41.engram-capacity"]
    assert (
        row.status == WARN and "could not tell the GPU" in row.detail and "Run doctor on the serving host" in row.detail
    )
    row = all_rows(flash, "-tp 8 --language-model-only")["v41.engram-capacity"]
    assert row.status == INFO and "within a GB10" in row.detail


@pytest.fixture
def v034():
    tree = pristine_tree("0.34.0")
    return Runtime(site_dirs=(tree,), vllm_root=tree, vllm_version="0.34.0")


def test_engram_config_keys_against_vllm_0_34(small, v034):
    pack = small()
    kit = """--engram-config '{"cpu_offload": false, "disk_backed": true}'"""
    row = all_rows(pack, kit, runtime=v034)["v41.engram-capacity"]
    assert row.status == FAIL and "disk_backed" in row.detail and "0.34.0" in row.detail
    row = all_rows(pack, """--engram-config '{"disk_offload": true}'""", runtime=v034)["v41.engram-capacity"]
    assert row.status == FAIL and "Qwen4Exp" in row.detail
    row = all_rows(pack, """--engram-config '{"use_thp": true}'""", runtime=v034)["v41.engram-capacity"]
    assert row.status != FAIL


def test_a_disk_backed_engram_kit_passes_capacity(small, tmp_path):
    runtime = fake_vllm(tmp_path / "site", version="0.34.0")
    kit = runtime.vllm_root / "vllm/models/deepseek_v41/common"
    kit.mkdir(parents=True)
    (kit / "engram_disk.py").write_text("class DiskBackedEngram: ...\n")
    row = all_rows(small(), "-tp 2", runtime=runtime, environ={"PATH": "", "VLLM_ENGRAM_DISK_BACKED": "1"})[
        "v41.engram-capacity"
    ]
    assert row.status == PASS and "engram_disk.py" in row.detail


def test_check_specs_are_bound_to_one_family_or_none():
    _register_checks()
    assert all(isinstance(spec, CheckSpec) and spec.family in (None, V4, V41) for spec in CHECKS)
    assert all(spec.id.startswith("v41.") for spec in CHECKS if spec.family == V41)


def test_the_sm120_decode_table_of_a_real_flashinfer_is_read_on_sm12x(flash, tmp_path):
    """FlashInfer 0.6.18.post1's _DECODE_DSV4_DISPATCH (a pair set) holds (32, 128) for TP2's 32 heads and the
    128-token window, and (32, 192) for a DSpark draft of 5 with use_non_causal; a 200-token draft widens
    the window to 384, which it lacks. FlashInfer 0.7.4's table is a run-time predicate: not judged."""
    pack = flash
    gb10 = tmp_path / "gb10"
    nvidia_smi(gb10, [GB10])
    site = tmp_path / "site"
    runtime = fake_vllm(site, version="0.30.0")
    install_flashinfer(site, "0.6.18.post1")
    environ = {"PATH": str(gb10)}
    ok = all_rows(pack, "-tp 2", runtime=runtime, environ=environ)["v41.flashinfer"]
    assert ok.status == PASS and "(heads=32, width=128) is in its SM120 decode table" in ok.detail, ok
    causal = """--attention-config '{"use_non_causal": true}' --speculative-config.method dspark"""
    assert "width=192" in all_rows(pack, f"-tp 2 {causal}", runtime=runtime, environ=environ)["v41.flashinfer"].detail
    wide = """--attention-config '{"use_non_causal": true}' --speculative-config '{"method": "dspark", \
"num_speculative_tokens": 200}'"""
    row = all_rows(pack, f"-tp 2 {wide}", runtime=runtime, environ=environ)["v41.flashinfer"]
    assert row.status == FAIL and "no SM120 DSV4 decode kernel for (heads=32, width=384)" in row.detail
    newer = tmp_path / "site-074"
    runtime = fake_vllm(newer, version="0.34.0")
    install_flashinfer(newer, "0.7.4")
    row = all_rows(pack, "-tp 2", runtime=runtime, environ=environ)["v41.flashinfer"]
    assert row.status == PASS and "run-time predicate" in row.detail
    assert "could not be told" in all_rows(pack, "-tp 2", runtime=runtime)["v41.flashinfer"].detail


# ------------------------------------------------------------------ the command


@pytest.fixture
def serving(make_tree, tmp_path, monkeypatch):
    """vLLM 0.30.0 (a real release tree), patched, with its FlashInfer, vllm-exl3, exllamav3_ext and torch; PATH
    holds only the test's tools (as test_doctor_command's fixture)."""
    tree = make_tree("0.30.0")
    install_flashinfer(tree, "0.6.18.post1")
    assert run_cli("apply", "--site-packages", tree).code == 0
    install_exllamav3(tree, "1.4.5", platform.machine())
    install_plugin(tree)
    install_torch(tree, "2.13.0+cu130")
    cuda_home, venv_bin, tools = toolchain(tmp_path)
    monkeypatch.setenv("PATH", f"{cuda_home / 'bin'}:{venv_bin}:{tools}")
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    for name in ("VLLM_PLUGINS", "PATCH_DSV4_GUARD", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    return tree


def test_the_command_on_a_v41_pack_and_a_real_release(serving, flash, tmp_path):
    """`patch-dsv4 doctor --json` on vLLM 0.30.0 (a real tree, patched) and the full-size pack: the report
    follows the schema, holds the V4.1 rows and none of the V4-only ones; a stub GB10 makes the Engram row
    decide (this machine's MemTotal is far below 188.8 GiB of tables: fail) and the exit status 1."""
    import jsonschema

    from tests.doctor.test_doctor_command import SCHEMA

    result = run_cli("doctor", "--site-packages", serving, "--pack", flash, "--serve-args", "-tp 2", "--json")
    assert "Traceback" not in result.stderr
    report = result.json()
    jsonschema.validate(report, SCHEMA)
    ids = {row["id"] for row in report["checks"]}
    assert set(v41_ids()) <= ids and not ids & v4_only_ids()
    v41 = {r["id"]: r for r in report["checks"] if r["id"].startswith("v41.")}
    assert not [r for r in v41.values() if r["status"] == FAIL], v41
    nvidia_smi(tmp_path / "tools", [GB10])
    result = run_cli("doctor", "--site-packages", serving, "--pack", flash, "--serve-args", "-tp 2", "--json")
    rows = {r["id"]: r for r in result.json()["checks"]}
    assert result.code == 1 and rows["v41.engram-capacity"]["status"] == FAIL
    assert "GB10" in rows["v41.engram-capacity"]["detail"]


def test_miaai_labs_file_backed_engram_passes_capacity_where_its_reader_is_installed(small, tmp_path):
    runtime = fake_vllm(tmp_path / "site", version="0.34.0")
    engram = runtime.vllm_root / "vllm/models/deepseek_v41/common"
    engram.mkdir(parents=True)
    (engram / "engram.py").write_text("table_dir = getattr(config, 'engram_table_dir', None)\n")
    overrides = """--hf-overrides '{"engram_table_dir": "/models/engram"}'"""
    row = all_rows(small(), f"-tp 2 {overrides}", runtime=runtime)["v41.engram-capacity"]
    assert row.status == PASS and "MiaAI-Lab" in row.detail
    tables = all_rows(small("mia"), f"-tp 2 {overrides}", runtime=runtime)["v41.engram-tables"]
    assert tables.status == PASS and "reads them from its own files" in tables.detail
    assert all_rows(small("mia"), "-tp 2", runtime=runtime)["v41.engram-tables"].status == FAIL
    bare = all_rows(small(), f"-tp 2 {overrides}", runtime=fake_vllm(tmp_path / "stock", version="0.34.0"))
    assert bare["v41.engram-capacity"].status != PASS  # no reader installed: the tables stay resident


def test_graph_capture_autotune_sees_a_v41_packs_dense_exl3_in_its_headers(small, tmp_path):
    """env.graphs-autotune (shared with V4) must not pass a dense-EXL3 V4.1 pack for want of non_routed_exl3."""
    runtime = fake_vllm(tmp_path / "site", version="0.34.0")
    row = all_rows(small("dense-exl3"), runtime=runtime)["env.graphs-autotune"]
    assert row.status == WARN and "dense EXL3 linears" in row.detail


def test_a_v41_pack_with_the_sources_quant_method_is_fixed_without_the_v4_recipe(small):
    """quant.method applies to V4.1 as to V4, but its fix must not send a V4.1 pack to the recipe's V4 fixer;
    --fix-config sets quant_method inside quantization_config and nothing else."""

    def fp8(config):
        config["quantization_config"]["quant_method"] = "fp8"

    pack = small("fp8", edit_config=fp8)
    row = run_pack_checks(pack)["quant.method"]
    assert row.status == FAIL and "fix_pack_config" not in row.fix and "--fix-config writes it" in row.fix
    before = json.loads((pack / "config.json").read_text())
    assert fix_config(pack).changed
    after = json.loads((pack / "config.json").read_text())
    before["quantization_config"]["quant_method"] = "exl3"
    assert after == before


def test_the_flattening_follows_vllms_config_class_on_its_order_and_defaults():
    """Checked against vLLM 0.34.0's DeepseekV41Config (transformers_utils/configs/deepseek_v41.py): the top
    level wins over a text key of the same name; the text keys' expert_dtype over the quantization block's;
    vision_n_layers is 0 without a vision_config."""
    source = (pristine_tree("0.34.0") / "vllm/transformers_utils/configs/deepseek_v41.py").read_text()
    assert "for key, value in text_config.items():" in source and "super().__init__(**kwargs)" in source
    assert source.index("setattr(self, key, value)") < source.index("super().__init__(**kwargs)")
    assert 'vision_config.get("num_hidden_layers", 0)' in source
    config = v41_config(SMALL41, vision=False)
    config["text_config"]["pad_token_id"] = 7
    config["text_config"]["expert_dtype"] = "fp8"
    config["quantization_config"]["expert_dtype"] = "fp4"
    flat = flatten_v41(config)
    assert flat["pad_token_id"] == 2 and flat["expert_dtype"] == "fp8" and flat["vision_n_layers"] == 0
