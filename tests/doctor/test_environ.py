"""The environment and flag checks on the two healthy deployments, then one mutation per rule."""

from __future__ import annotations

import pytest

import patch_dsv4.doctor.checks.environ  # noqa: F401  (registers the env.* and flags.* checks)
from tests.doctor.fake_runtime import (
    DEPLOYMENTS,
    check_row,
    install_plugin,
    lna_lab,
    module_rows,
    plugin_source,
    vcruz305,
)

MEGAMOE = "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_healthy_deployment_has_no_failing_environment_row(tmp_path, name):
    ctx = DEPLOYMENTS[name](tmp_path).context()
    rows = module_rows(ctx, "env.") + module_rows(ctx, "flags.")
    assert [r for r in rows if r.status == "fail"] == []
    assert len(rows) == 9


# --- env.unknown-vllm: judged against each release's own envs.py -------------------------------


def test_unknown_vllm_variable_warns(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.environ["VLLM_FOO"] = "1"
    row = check_row(deployment.context(), "env.unknown-vllm")
    assert row.status == "warn"
    assert row.detail.startswith("VLLM_FOO is unknown to vLLM 0.33.0")
    assert row.fix == "unset VLLM_FOO"


@pytest.mark.parametrize("vllm, flashinfer, status", [("0.28.0", "0.6.18", "warn"), ("0.29.0", "0.6.18", "pass")])
def test_megamoe_variable_exists_only_from_0_29(tmp_path, vllm, flashinfer, status):
    deployment = vcruz305(tmp_path, vllm=vllm, flashinfer=flashinfer)
    deployment.environ[MEGAMOE] = "1"
    row = check_row(deployment.context(), "env.unknown-vllm")
    assert row.status == status
    if status == "warn":
        assert row.fix == f"unset {MEGAMOE}"


def test_plugin_variables_alone_are_harmless(tmp_path):
    row = check_row(lna_lab(tmp_path).context(), "env.unknown-vllm")  # VLLM_EXL3_MOE_KERNEL=lna2
    assert row.status == "info"
    assert row.detail.startswith("VLLM_EXL3_MOE_KERNEL is read by vllm-exl3")


def test_fail_on_environ_validation_turns_unknown_variables_into_a_failure(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.serve_args += " --fail-on-environ-validation"
    row = check_row(deployment.context(), "env.unknown-vllm")
    assert row.status == "fail"
    assert "raises ValueError at startup" in row.detail
    assert row.fix.startswith("drop --fail-on-environ-validation")


# --- env.int-parse -----------------------------------------------------------------------------


def test_true_is_not_an_integer(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "true"
    row = check_row(deployment.context(), "env.int-parse")
    assert row.status == "fail"
    assert row.detail.startswith("VLLM_DISABLE_SHARED_EXPERTS_STREAM='true' must be an integer")
    assert row.fix == "export VLLM_DISABLE_SHARED_EXPERTS_STREAM=1"


def test_integer_parsed_through_a_helper_is_checked(tmp_path):
    deployment = lna_lab(tmp_path)  # 0.33.0: VLLM_SPARSE_INDEXER_MAX_LOGITS_MB is int(os.getenv(...))
    deployment.environ["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = "128MB"
    row = check_row(deployment.context(), "env.int-parse")
    assert row.status == "fail"
    assert row.fix == "export VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=<integer>"


# --- env.shared-stream -------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "0", "true"])
def test_exl3_shared_experts_need_the_stream_off(tmp_path, value):
    deployment = lna_lab(tmp_path)
    if value is None:
        del deployment.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"]
    else:
        deployment.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = value
    row = check_row(deployment.context(), "env.shared-stream")
    assert row.status == "fail"
    assert "deadlocks exllamav3's per-device lock" in row.detail
    assert row.fix == "export VLLM_DISABLE_SHARED_EXPERTS_STREAM=1"


def test_routed_only_exl3_pack_needs_no_shared_stream_switch(tmp_path):
    assert check_row(vcruz305(tmp_path).context(), "env.shared-stream").status == "pass"


# --- env.aux-streams ---------------------------------------------------------------------------


def test_exl3_attention_without_the_switch_warns(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["LNA_DSV4_AUX_STREAMS"]
    row = check_row(deployment.context(), "env.aux-streams")
    assert row.status == "warn"
    assert "PATCH_DSV4_AUX_STREAMS=0 is not set" in row.detail
    assert (
        row.fix
        == f"patch-dsv4 apply --with aux-streams --site-packages {deployment.site} && export PATCH_DSV4_AUX_STREAMS=0"
    )


def test_exl3_attention_without_the_patch_warns(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.set_verdict("aux-streams", "opt-in")
    row = check_row(deployment.context(), "env.aux-streams")
    assert row.status == "warn"
    assert "the aux-streams patch is opt-in" in row.detail


def test_patch_dsv4_switch_counts_like_lna_labs(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["LNA_DSV4_AUX_STREAMS"]
    deployment.environ["PATCH_DSV4_AUX_STREAMS"] = "0"
    assert check_row(deployment.context(), "env.aux-streams").status == "pass"


@pytest.mark.parametrize("value,status", [("1", "pass"), ("0", "warn")])
def test_miaai_serial_streams_switch_counts_when_1(tmp_path, value, status):
    deployment = lna_lab(tmp_path)
    del deployment.environ["LNA_DSV4_AUX_STREAMS"]
    deployment.environ["DSV41_EXL3_SERIAL_STREAMS"] = value
    row = check_row(deployment.context(), "env.aux-streams")
    assert row.status == status
    if status == "pass":
        assert "DSV41_EXL3_SERIAL_STREAMS=1" in row.detail


# --- env.graphs-autotune -----------------------------------------------------------------------


def test_graphs_with_dense_exl3_and_no_tune_cache_warn(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["EXLLAMAV3_TUNE_CACHE"]
    row = check_row(deployment.context(), "env.graphs-autotune")
    assert row.status == "warn"
    assert "operation not permitted when stream is capturing" in row.detail
    assert row.fix.startswith("add --enforce-eager")


def test_an_empty_tune_cache_does_not_count(tmp_path):
    deployment = lna_lab(tmp_path)
    (tmp_path / "exl3-tune-cache/coop_autotune_v1.bin").write_bytes(b"")
    assert check_row(deployment.context(), "env.graphs-autotune").status == "warn"


def test_capture_guarded_sources_pass(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["EXLLAMAV3_TUNE_CACHE"]
    gemm = deployment.site / "exllamav3/exllamav3_ext/quant/exl3_gemm.cu"
    gemm.write_text(
        gemm.read_text() + "\nstatic bool lna_stream_is_capturing(cudaStream_t s) "
        "{ cudaStreamCaptureStatus st; cudaStreamIsCapturing(s, &st); return st; }\n"
    )
    assert check_row(deployment.context(), "env.graphs-autotune").status == "pass"


def test_cudagraph_mode_none_is_eager_enough(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["EXLLAMAV3_TUNE_CACHE"]
    deployment.serve_args += """ --compilation-config '{"cudagraph_mode": "NONE"}'"""
    assert check_row(deployment.context(), "env.graphs-autotune").status == "pass"


def test_routed_only_pack_without_native_moe_warns_with_graphs_on(tmp_path):
    deployment = vcruz305(tmp_path)  # no vllm_exl3_c: routed experts go through exllamav3
    deployment.serve_args = deployment.serve_args.replace(" --enforce-eager", "")
    row = check_row(deployment.context(), "env.graphs-autotune")
    assert row.status == "warn"
    assert "routed experts without vllm_exl3_c" in row.detail


# --- env.alloc-conf ----------------------------------------------------------------------------


@pytest.mark.parametrize("length", ["262144", "256K", "300k"])
def test_long_context_without_expandable_segments_warns(tmp_path, length):
    deployment = lna_lab(tmp_path)
    deployment.serve_args = deployment.serve_args.replace("--max-model-len 65536", f"--max-model-len {length}")
    row = check_row(deployment.context(), "env.alloc-conf")
    assert row.status == "warn"
    assert row.fix == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


@pytest.mark.parametrize("flag", ["", "--max-model-len auto ", "--max-model-len -1 "])
def test_without_a_max_model_len_the_pack_length_counts(tmp_path, flag):
    deployment = lna_lab(tmp_path)
    deployment.serve_args = deployment.serve_args.replace("--max-model-len 65536 ", flag)
    row = check_row(deployment.context(), "env.alloc-conf")
    assert row.status == "warn"
    assert row.detail.startswith("max_position_embeddings is 1,048,576 tokens")


# --- env.exl3-vars -----------------------------------------------------------------------------


def test_fused_moe_off_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.environ["EXL3_FUSED_MOE"] = "0"
    row = check_row(deployment.context(), "env.exl3-vars")
    assert row.status == "warn"
    assert row.fix == "unset EXL3_FUSED_MOE"


def test_kernel_the_installed_plugin_does_not_know_warns(tmp_path):
    deployment = vcruz305(tmp_path)  # the upstream plugin: native, exllamav3, auto
    deployment.environ["VLLM_EXL3_MOE_KERNEL"] = "lna2"
    row = check_row(deployment.context(), "env.exl3-vars")
    assert row.status == "warn"
    assert "not one of auto, exllamav3, native" in row.detail
    assert row.fix == "export VLLM_EXL3_MOE_KERNEL=auto (or one of auto, exllamav3, native)"


def test_kernel_variable_ignored_by_an_old_plugin_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    install_plugin(deployment.site, version="0.2.3", source=plugin_source(kernels=None))
    deployment.environ["VLLM_EXL3_MOE_KERNEL"] = "native"
    row = check_row(deployment.context(), "env.exl3-vars")
    assert row.status == "warn"
    assert row.fix == "unset VLLM_EXL3_MOE_KERNEL"


# --- flags.recipe ------------------------------------------------------------------------------


def test_kv_cache_dtype_other_than_fp8_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = deployment.serve_args.replace("--kv-cache-dtype fp8", "--kv-cache-dtype auto")
    row = check_row(deployment.context(), "flags.recipe")
    assert row.status == "warn"
    assert row.detail.endswith("--kv-cache-dtype is auto.")
    assert row.fix == "serve with --kv-cache-dtype fp8 --quantization exl3"


def test_absent_flags_leave_it_to_the_config(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = "--max-model-len 65536"
    assert check_row(deployment.context(), "flags.recipe").status == "info"


def test_no_serve_args_skips(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = ""
    assert check_row(deployment.context(), "flags.recipe").status == "skip"


# --- env.dense-exl3 ----------------------------------------------------------------------------


def _with_slices(deployment, tmp_path):
    """The Dense6 bake with wo_a stored per group: a real synthetic pack whose headers hold attn.wo_a.slice.G."""
    from tests.doctor.synthetic import build_lna_dense_pack

    deployment.pack = build_lna_dense_pack(tmp_path / "dense6")
    return deployment


def test_dense_exl3_pack_with_the_patches_passes(tmp_path):
    row = check_row(lna_lab(tmp_path).context(), "env.dense-exl3")
    assert row.status == "pass" and "dense-exl3 is applied" in row.detail


def test_routed_only_pack_needs_no_dense_exl3(tmp_path):
    row = check_row(vcruz305(tmp_path).context(), "env.dense-exl3")
    assert row.status == "pass" and "not needed" in row.detail


def test_dense_exl3_pack_without_the_patch_fails_with_the_exact_command(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.set_verdict("dense-exl3", "opt-in")
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.status == "fail" and "dense-exl3 is opt-in" in row.detail
    site = deployment.site
    assert row.fix == (
        f"patch-dsv4 apply --with dense-exl3 --site-packages {site} "
        f"(over lna-lab's scripts: patch-dsv4 takeover --with dense-exl3 --site-packages {site})"
    )


def test_the_command_keeps_recommending_aux_streams(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.set_verdict("dense-exl3", "opt-in")
    deployment.set_verdict("aux-streams", "opt-in")
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.fix.startswith(
        f"patch-dsv4 apply --with dense-exl3 --with aux-streams --site-packages {deployment.site}"
    )
    assert check_row(deployment.context(), "env.aux-streams").status == "warn"


def test_wo_a_slices_need_their_patch(tmp_path):
    deployment = _with_slices(lna_lab(tmp_path), tmp_path)
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.status == "fail" and "attn.wo_a.slice." in row.detail and "exl3-wo-a-slices is opt-in" in row.detail
    assert row.fix.startswith("patch-dsv4 apply --with dense-exl3 --with exl3-wo-a-slices --site-packages")


def test_slices_in_the_index_alone_count(tmp_path):
    import json

    deployment = lna_lab(tmp_path)
    index = {"weight_map": {"layers.0.attn.wo_a.slice.3.trellis": "model-00001-of-00004.safetensors"}}
    (deployment.pack / "model.safetensors.index.json").write_text(json.dumps(index))
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.status == "fail" and "layers.0.attn.wo_a.slice.3.trellis" in row.detail


def test_a_plugin_without_a_per_rank_wo_a_loader_cannot_load_slices(tmp_path):
    deployment = _with_slices(lna_lab(tmp_path), tmp_path)
    deployment.set_verdict("exl3-wo-a-slices", "applied")
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.status == "fail" and "cannot load wo_a slices" in row.detail and "_wo_a_slice_rank" in row.fix
    lna_fork = (
        plugin_source() + "\n\ndef _wo_a_slice_rank(name):\n    return int(name.split('.slice.')[1].split('.')[0])\n"
    )
    install_plugin(deployment.site, source=lna_fork)
    row = check_row(deployment.context(), "env.dense-exl3")
    assert row.status == "pass" and "loads wo_a slices" in row.detail
