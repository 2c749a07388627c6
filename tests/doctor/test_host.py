"""The host checks on the two healthy deployments, then one mutation per rule, and tools that misbehave."""

from __future__ import annotations

import time

import pytest

import patch_dsv4.doctor.checks.host  # noqa: F401  (registers the host.* checks)
from patch_dsv4.doctor.readers import serving_env
from tests.doctor.fake_runtime import (
    DEPLOYMENTS,
    check_row,
    cuobjdump,
    lna_lab,
    module_rows,
    nvidia_smi,
    vcruz305,
    write_meminfo,
    write_pack,
    write_tool,
)

GB10 = ("NVIDIA GB10", "12.1", "[N/A]")
HOST_CHECKS = ("host.gpu", "host.ext-arch", "host.page-cache", "host.sorted-load", "host.other-model", "host.kv-budget")


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_healthy_deployment_has_no_failing_host_row(tmp_path, name):
    rows = module_rows(DEPLOYMENTS[name](tmp_path).context(), "host.")
    assert [r for r in rows if r.status in ("fail", "warn")] == []
    assert tuple(r.id for r in rows) == HOST_CHECKS


# --- tools that are missing or misbehave: skip, never a failure or a traceback -----------------


def _gpu_rows(deployment):
    ctx = deployment.context()
    return {check_id: check_row(ctx, check_id) for check_id in ("host.gpu", "host.page-cache", "host.other-model")}


def test_without_nvidia_smi_the_gpu_rows_skip(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.path_without(deployment.tools)
    rows = _gpu_rows(deployment)
    assert {r.status for r in rows.values()} == {"skip"}
    assert rows["host.gpu"].detail == "no GPU to read: nvidia-smi is not on PATH"


def test_nvidia_smi_printing_nonsense_skips(tmp_path):
    deployment = vcruz305(tmp_path)
    write_tool(deployment.tools, "nvidia-smi", r"printf 'NVIDIA-SMI has failed, \x01\x02 garbage,,\n42\n'")
    rows = _gpu_rows(deployment)
    assert {r.status for r in rows.values()} == {"skip"}
    assert "printed no GPU line doctor can read" in rows["host.gpu"].detail


def test_nvidia_smi_failing_skips(tmp_path):
    deployment = vcruz305(tmp_path)
    write_tool(deployment.tools, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate'; exit 9")
    row = check_row(deployment.context(), "host.gpu")
    assert row.status == "skip"
    assert row.detail == "no GPU to read: nvidia-smi exited with status 9"


def test_nvidia_smi_hanging_is_killed_and_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_env, "TOOL_TIMEOUT_S", 0.3)
    deployment = vcruz305(tmp_path)
    write_tool(deployment.tools, "nvidia-smi", "exec /bin/sleep 30")
    started = time.monotonic()
    row = check_row(deployment.context(), "host.gpu")
    assert time.monotonic() - started < 5
    assert row.status == "skip"
    assert "did not answer within 0.3 s" in row.detail


# --- host.gpu ----------------------------------------------------------------------------------


def test_gpu_row_names_the_attention_path(tmp_path):
    row = check_row(lna_lab(tmp_path).context(), "host.gpu")
    assert row.status == "info"
    assert row.detail.startswith("8 x NVIDIA RTX PRO 2000 Blackwell sm_120: FlashInfer SM120")


def test_other_architectures_take_flashmla(tmp_path):
    deployment = vcruz305(tmp_path)
    nvidia_smi(deployment.tools, [("NVIDIA H200", "9.0", "143771")])
    assert "FlashMLA" in check_row(deployment.context(), "host.gpu").detail


# --- host.ext-arch -----------------------------------------------------------------------------


def test_extension_built_for_sm_120a_only_warns_on_gb10(tmp_path):
    deployment = vcruz305(tmp_path)
    cuobjdump(deployment.cuda_home / "bin", ["sm_120a"])
    row = check_row(deployment.context(), "host.ext-arch")
    assert row.status == "warn"
    assert "none of which runs on sm_121" in row.detail
    assert "TORCH_CUDA_ARCH_LIST='12.1a'" in row.fix


def test_plain_sm_120_cubin_runs_on_sm_121(tmp_path):
    deployment = vcruz305(tmp_path)
    cuobjdump(deployment.cuda_home / "bin", ["sm_120"])
    assert check_row(deployment.context(), "host.ext-arch").status == "pass"


def test_without_cuobjdump_the_cubins_are_not_judged(tmp_path):
    deployment = vcruz305(tmp_path)
    (deployment.cuda_home / "bin/cuobjdump").unlink()
    row = check_row(deployment.context(), "host.ext-arch")
    assert row.status == "skip"
    assert "cuobjdump is not on PATH" in row.detail


# --- host.page-cache ---------------------------------------------------------------------------


def test_page_cache_on_unified_memory_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    write_meminfo(deployment.proc, total_kb=127_601_092, free_kb=30_000_000, cached_kb=92_000_000)
    row = check_row(deployment.context(), "host.page-cache")
    assert row.status == "warn"
    assert "87.7 GiB in the page cache" in row.detail
    assert "drop_caches" in row.fix
    assert row.fix.endswith("lower --gpu-memory-utilization to 0.23")


def test_page_cache_on_discrete_gpus_does_not_count(tmp_path):
    deployment = lna_lab(tmp_path)
    write_meminfo(deployment.proc, total_kb=263_000_000, free_kb=1_000_000, cached_kb=250_000_000)
    assert check_row(deployment.context(), "host.page-cache").status == "pass"


def test_garbage_meminfo_skips(tmp_path):
    deployment = vcruz305(tmp_path)
    (deployment.proc / "meminfo").write_bytes(b"\xff\xfeMemTotal: lots\n")
    assert check_row(deployment.context(), "host.page-cache").status == "skip"


# --- host.sorted-load --------------------------------------------------------------------------


def _on_0_30(tmp_path):
    deployment = vcruz305(tmp_path, vllm="0.30.0", flashinfer="0.6.18.post1")
    deployment.set_verdict("stream-load", "pending")
    write_pack(deployment.pack, deployment.context().config(), total_bytes=140 * 10**9)  # more than MemTotal
    return deployment


def test_pending_stream_load_with_a_pack_bigger_than_memory_fails(tmp_path):
    deployment = _on_0_30(tmp_path)
    row = check_row(deployment.context(), "host.sorted-load")
    assert row.status == "fail"
    assert "vLLM 0.30.0's vision loader holds the whole pack (140 GB) in host memory" in row.detail
    assert row.fix == f"patch-dsv4 apply --site-packages {deployment.site}"


def test_unified_memory_counts_the_loaded_weights_too(tmp_path):
    deployment = _on_0_30(tmp_path)
    write_pack(deployment.pack, deployment.context().config(), total_bytes=95 * 10**9)  # the vcruz305 pack on a GB10
    row = check_row(deployment.context(), "host.sorted-load")
    assert row.status == "fail"
    assert "2.2 x that (on unified memory" in row.detail


def test_applied_stream_load_passes(tmp_path):
    deployment = _on_0_30(tmp_path)
    deployment.set_verdict("stream-load", "applied")
    assert check_row(deployment.context(), "host.sorted-load").status == "pass"


def test_without_verdicts_the_version_tells(tmp_path):
    deployment = _on_0_30(tmp_path)
    deployment.change_runtime(patch_verdicts=None)
    assert check_row(deployment.context(), "host.sorted-load").status == "fail"


def test_text_pack_is_never_sorted(tmp_path):
    deployment = _on_0_30(tmp_path)
    config = deployment.context().config()
    config["vision_n_layers"] = 0
    write_pack(deployment.pack, config, total_bytes=140 * 10**9)
    assert check_row(deployment.context(), "host.sorted-load").status == "pass"


# --- host.other-model --------------------------------------------------------------------------


def test_another_gpu_process_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    nvidia_smi(deployment.tools, [GB10], apps=[(4242, "/usr/bin/python3", "[N/A]")])
    row = check_row(deployment.context(), "host.other-model")
    assert row.status == "warn"
    assert row.detail == "another process is using the GPU: 4242 (/usr/bin/python3)."
    assert row.fix.startswith("stop it before serving (kill 4242)")


# --- host.kv-budget ----------------------------------------------------------------------------


def test_weights_alone_over_the_budget_warn(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = deployment.serve_args.replace(
        "--gpu-memory-utilization 0.92", "--gpu-memory-utilization 0.5"
    )
    row = check_row(deployment.context(), "host.kv-budget")
    assert row.status == "warn"
    assert "the weights alone exceed" in row.detail


def test_wide_prefill_chunks_at_256k_warn(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = deployment.serve_args.replace("--max-model-len 65536", "--max-model-len 262144").replace(
        "--max-num-batched-tokens 2048", "--max-num-batched-tokens 8192"
    )
    row = check_row(deployment.context(), "host.kv-budget")
    assert row.status == "warn"
    assert row.fix == "serve with --max-num-batched-tokens 2048"


def test_kv_upper_bound_over_the_budget_is_information(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.serve_args = deployment.serve_args.replace("--max-model-len 65536", "--max-model-len 1M")
    row = check_row(deployment.context(), "host.kv-budget")
    assert row.status == "info"
    assert "KV for 1,048,576 tokens at most 24.2 GiB" in row.detail
