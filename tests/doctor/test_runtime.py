"""The runtime checks on the two healthy deployments, then one mutation per rule."""

from __future__ import annotations

import json
import shlex
import shutil
import sys

import pytest

import patch_dsv4.doctor.checks.overlay  # noqa: F401  (registers rt.overlay-imports)
import patch_dsv4.doctor.checks.runtime  # noqa: F401  (registers the rt.* checks)
from tests.doctor import pip_index
from tests.doctor.fake_runtime import (
    DEPLOYMENTS,
    EM_X86_64,
    check_row,
    check_rows,
    elf_bytes,
    extension_name,
    install_exllamav3,
    install_plugin,
    install_torch,
    lna_lab,
    module_rows,
    plugin_source,
    remove_extension,
    vcruz305,
    write_tool,
)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_healthy_deployment_has_no_failing_runtime_row(tmp_path, name):
    rows = module_rows(DEPLOYMENTS[name](tmp_path).context(), "rt.")
    assert [r for r in rows if r.status == "fail"] == []
    assert {r.id for r in rows} == {
        "rt.python",
        "rt.vllm-route",
        "rt.patches",
        "rt.flashinfer",
        "rt.flashinfer-jit",
        "rt.exllamav3-ext",
        "rt.exllamav3-api",
        "rt.plugin",
        "rt.plugin-features",
        "rt.plugin-native",
        "rt.torch",
        "rt.overlay-imports",
        "rt.hooks",
    }


# --- rt.python ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, status", [("3.11.9", "fail"), ("3.13.1", "warn"), ("3.12.3", "pass"), (None, "skip")]
)
def test_python_floor_and_recipe_version(tmp_path, version, status):
    deployment = vcruz305(tmp_path)
    deployment.change_runtime(python_version=version)
    row = check_row(deployment.context(), "rt.python")
    assert row.status == status
    if status in ("fail", "warn"):
        assert "python3.12 -m venv" in row.fix


# --- rt.vllm-route -----------------------------------------------------------------------------


def test_vision_pack_on_a_build_without_the_vision_class_serves_text_only(tmp_path):
    row = check_row(vcruz305(tmp_path).context(), "rt.vllm-route")  # stock 0.28.0
    assert row.status == "warn"
    assert "serves text only" in row.detail
    assert "install vLLM 0.30.0 or later" in row.fix


def test_vision_class_is_found_in_the_code(tmp_path):
    row = check_row(vcruz305(tmp_path, vllm="0.30.0", flashinfer="0.6.18.post1").context(), "rt.vllm-route")
    assert row.status == "info"
    assert "has the DeepSeek-V4 vision class" in row.detail


def test_vllm_without_deepseek_v4_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    shutil.rmtree(deployment.site / "vllm/models/deepseek_v4")
    row = check_row(deployment.context(), "rt.vllm-route")
    assert row.status == "fail"
    assert "cannot load DeepSeek-V4" in row.detail


# --- rt.patches --------------------------------------------------------------------------------


def _patch_row(ctx, patch_id):
    (row,) = [r for r in check_rows(ctx, "rt.patches") if r.detail.startswith(f"patch {patch_id} ")]
    return row


@pytest.mark.parametrize(
    "verdict, status",
    [
        ("pending", "fail"),
        ("drifted", "fail"),
        ("modified", "fail"),
        ("applied", "pass"),
        ("upstream", "pass"),
        ("not-applicable", "pass"),
        ("opt-in", "info"),
    ],
)
def test_each_patch_verdict_has_its_status(tmp_path, verdict, status):
    deployment = vcruz305(tmp_path, vllm="0.30.0", flashinfer="0.6.18.post1")
    deployment.set_verdict("wide-swa", verdict)
    row = _patch_row(deployment.context(), "wide-swa")
    assert row.status == status
    if status == "fail":
        assert f"patch-dsv4 apply --site-packages {deployment.site}" in row.fix
        assert "Unsupported sparse-MLA prefill configuration" in row.detail


def test_pending_patch_names_its_late_symptom(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.set_verdict("dtype-policy", "pending")
    row = _patch_row(deployment.context(), "dtype-policy")
    assert row.status == "fail"
    assert "weight_scale_inv" in row.detail
    assert row.fix == f"patch-dsv4 apply --site-packages {deployment.site}"


def test_every_patch_says_what_serving_without_it_does_and_doctor_prints_that(tmp_path):
    """The serve-time impact lives on the patch (Patch.serve_impact), not in a doctor table keyed by id."""
    from patch_dsv4.patching.registry import discover_patches

    deployment = vcruz305(tmp_path)
    for patch in discover_patches():
        assert patch.serve_impact, patch.id
        deployment.set_verdict(patch.id, "drifted")
        row = _patch_row(deployment.context(), patch.id)
        assert row.status == "fail" and f"without it {patch.serve_impact}." in row.detail


def test_without_verdicts_the_patch_row_is_skipped(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.change_runtime(patch_verdicts=None)
    assert [r.status for r in check_rows(deployment.context(), "rt.patches")] == ["skip"]


# --- rt.flashinfer -----------------------------------------------------------------------------


def test_flashinfer_0_6_16_has_no_decode_kernel_for_topk_192(tmp_path, monkeypatch):
    pip_index.serve(monkeypatch, tmp_path, ["0.6.16.post3", "0.6.18", "0.7.4"])
    deployment = vcruz305(tmp_path, flashinfer="0.6.16.post3")  # vLLM 0.28.0's own pin
    row = check_row(deployment.context(), "rt.flashinfer")
    assert row.status == "fail"
    assert "(heads=64, topk=192) is not in flashinfer/mla/_sparse_mla_sm120.py" in row.detail
    assert row.fix == (
        f"pip install --no-deps --upgrade --target {deployment.site} flashinfer-python==0.6.18 "
        "(vLLM 0.28.0 pins 0.6.16.post3: override it)"
    )


def test_flashinfer_0_6_16_serves_topk_512(tmp_path):
    deployment = vcruz305(tmp_path, flashinfer="0.6.16.post3")
    config = deployment.context().config()
    config["index_topk"] = 512
    (deployment.pack / "config.json").write_text(json.dumps(config))
    assert check_row(deployment.context(), "rt.flashinfer").status == "pass"


def test_tensor_parallel_divides_the_heads(tmp_path):
    deployment = lna_lab(tmp_path, vllm="0.30.0", flashinfer="0.6.18.post1")  # a literal table
    row = check_row(deployment.context(), "rt.flashinfer")
    assert row.status == "pass"
    assert "(heads=8, topk=192)" in row.detail


def test_a_predicate_table_is_judged_by_version(tmp_path):
    row = check_row(lna_lab(tmp_path).context(), "rt.flashinfer")  # FlashInfer 0.7.2.post1
    assert row.status == "pass"
    assert "run-time predicate" in row.detail


def test_flashinfer_not_installed_fails_with_the_pin(tmp_path, monkeypatch):
    pip_index.serve(monkeypatch, tmp_path, ["0.7.2.post1", "0.7.4"])
    deployment = lna_lab(tmp_path)
    shutil.rmtree(deployment.site / "flashinfer")
    deployment.change_runtime(flashinfer_source="pinned", target_args=" --python /opt/venv/bin/python")
    row = check_row(deployment.context(), "rt.flashinfer")
    assert row.status == "fail"
    assert row.fix == "/opt/venv/bin/python -m pip install flashinfer-python==0.7.2.post1 (vLLM 0.33.0's pin)"


def _pin(site, version: str) -> None:
    """vLLM's METADATA in ``site`` made to pin flashinfer-python==version (0.34.0 pins 0.7.3)."""
    (metadata,) = site.glob("vllm-*.dist-info/METADATA")
    text = metadata.read_text()
    pinned = [line for line in text.splitlines() if line.startswith("Requires-Dist: flashinfer-python")]
    new = f"Requires-Dist: flashinfer-python=={version}"
    metadata.write_text(text.replace(pinned[0], new) if pinned else text + new + "\n")


def test_a_pin_pips_index_does_not_serve_is_fixed_with_the_nearest_version_it_serves(tmp_path, monkeypatch):
    """vLLM 0.34.0 pins flashinfer-python==0.7.3, which the index does not serve (0.7.2.post1 and 0.7.4): the fix
    names 0.7.4 and says why, with the serving interpreter's pip, not whichever is on PATH."""
    pip_index.serve(monkeypatch, tmp_path, ["0.7.2.post1", "0.7.4"])
    deployment = lna_lab(tmp_path)
    _pin(deployment.site, "0.7.3")
    shutil.rmtree(deployment.site / "flashinfer")
    deployment.change_runtime(target_args=" --python /opt/venv/bin/python")
    row = check_row(deployment.context(), "rt.flashinfer")
    assert row.status == "fail"
    assert row.fix == (
        "/opt/venv/bin/python -m pip install flashinfer-python==0.7.4 "
        "(vLLM 0.33.0 pins 0.7.3, which pip's index does not serve; 0.7.4 is the nearest above it)"
    )
    deployment.change_runtime(target_args="")  # doctor's own interpreter's environment
    assert check_row(deployment.context(), "rt.flashinfer").fix.startswith(
        f"{shlex.quote(sys.executable)} -m pip install flashinfer-python==0.7.4 "
    )


def test_offline_the_fix_names_a_range_and_how_to_see_what_is_served(tmp_path, monkeypatch):
    pip_index.offline(monkeypatch)
    deployment = lna_lab(tmp_path)
    _pin(deployment.site, "0.7.3")
    shutil.rmtree(deployment.site / "flashinfer")
    row = check_row(deployment.context(), "rt.flashinfer")
    assert row.fix == (
        f"pip install --no-deps --upgrade --target {deployment.site} 'flashinfer-python>=0.7.3,<0.8' "
        "(vLLM 0.33.0's pin) (pip's index could not be asked whether it serves 0.7.3; "
        f"{shlex.quote(sys.executable)} -m pip index versions flashinfer-python lists what it serves)"
    )
    assert "==0.7.3" not in row.fix


def test_flashinfer_table_does_not_apply_to_flashmla_gpus(tmp_path):
    deployment = vcruz305(tmp_path, flashinfer="0.6.16.post3")
    write_tool(deployment.tools, "nvidia-smi", 'echo "NVIDIA H200, 9.0, 143771"')
    assert check_row(deployment.context(), "rt.flashinfer").status == "info"


# --- rt.flashinfer-jit: the rule is read from each release's vllm/utils/flashinfer.py ----------


def test_0_28_needs_nvcc_on_path(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.path_without(deployment.cuda_home / "bin")
    row = check_row(deployment.context(), "rt.flashinfer-jit")
    assert row.status == "fail"
    assert row.detail == "vLLM 0.28.0 will disable FlashInfer: nvcc is not on PATH."
    assert row.fix == "export PATH=/usr/local/cuda-13.0/bin:$PATH"


def test_0_28_ignores_cuda_home_and_ninja(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.environ["CUDA_HOME"] = str(tmp_path / "no-toolkit")
    deployment.path_without(deployment.venv_bin)
    assert check_row(deployment.context(), "rt.flashinfer-jit").status == "pass"


@pytest.mark.parametrize("vllm, flashinfer", [("0.32.0", "0.7.0.post1"), ("0.33.0", "0.7.2.post1")])
def test_0_32_and_later_resolve_nvcc_through_cuda_home(tmp_path, vllm, flashinfer):
    deployment = lna_lab(tmp_path, vllm=vllm, flashinfer=flashinfer)
    deployment.environ["CUDA_HOME"] = str(tmp_path / "no-toolkit")  # nvcc is still on PATH
    row = check_row(deployment.context(), "rt.flashinfer-jit")
    assert row.status == "fail"
    assert f"CUDA_HOME={tmp_path / 'no-toolkit'} has no bin/nvcc" in row.detail
    assert row.fix == "export CUDA_HOME=/usr/local/cuda-13.0 (a toolkit with bin/nvcc)"


def test_0_33_falls_back_to_the_path_nvcc_without_cuda_home(tmp_path):
    deployment = lna_lab(tmp_path)
    del deployment.environ["CUDA_HOME"]
    assert check_row(deployment.context(), "rt.flashinfer-jit").status == "pass"


def test_0_33_needs_ninja(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.path_without(deployment.venv_bin)
    row = check_row(deployment.context(), "rt.flashinfer-jit")
    assert row.status == "fail"
    assert "ninja is not on PATH" in row.detail
    assert row.fix.startswith(
        f"pip install --no-deps --upgrade --target {deployment.site} ninja and put {deployment.site}/bin on PATH"
    )


def test_flashinfer_cubin_waives_the_toolchain(tmp_path):
    deployment = lna_lab(tmp_path)
    deployment.path_without(deployment.venv_bin)
    (deployment.site / "flashinfer_cubin").mkdir()
    assert check_row(deployment.context(), "rt.flashinfer-jit").status == "pass"


# --- rt.exllamav3-ext --------------------------------------------------------------------------


def test_jit_only_exllamav3_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    remove_extension(deployment.site)
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "not installed as a compiled extension" in row.detail
    assert (
        f"TORCH_CUDA_ARCH_LIST='12.1a' pip install --no-deps --upgrade --target {deployment.site} "
        "--no-build-isolation ./exllamav3" in row.fix
    )
    assert "patch_exllamav3_aarch64.py" in row.fix


def test_extension_tagged_for_another_machine_is_passed_over(tmp_path):
    deployment = vcruz305(tmp_path)
    remove_extension(deployment.site)
    (deployment.site / extension_name("exllamav3_ext", "312", "x86_64")).write_bytes(elf_bytes(EM_X86_64))
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "exllamav3_ext.cpython-312-x86_64-linux-gnu.so (built for x86_64)" in row.detail


def test_untagged_x86_64_extension_on_aarch64_fails_on_its_elf_header(tmp_path):
    deployment = vcruz305(tmp_path)
    remove_extension(deployment.site)
    (deployment.site / "exllamav3_ext.so").write_bytes(elf_bytes(EM_X86_64))
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "exllamav3_ext.so is built for x86_64, the serving machine is aarch64" in row.detail


def test_extension_for_another_python_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    remove_extension(deployment.site)
    install_exllamav3(deployment.site, "1.4.5", "aarch64", python_tag="311")
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "(built for Python 3.11)" in row.detail


def test_exllamav3_1_4_0_is_below_the_floor(tmp_path):
    deployment = vcruz305(tmp_path)
    shutil.rmtree(deployment.site / "exllamav3-1.4.5.dist-info")
    install_exllamav3(deployment.site, "1.4.0", "aarch64")
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "exllamav3 1.4.0 is older than 1.4.5" in row.detail


def test_extension_shorter_than_an_elf_header_fails_without_a_traceback(tmp_path):
    deployment = vcruz305(tmp_path)
    (extension,) = deployment.site.glob("exllamav3_ext*.so")
    extension.write_bytes(b"\x7fELF\x02")
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "fail"
    assert "truncated or malformed (5 header bytes)" in row.detail


def test_extension_without_exl3_moe_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    (extension,) = deployment.site.glob("exllamav3_ext*.so")
    extension.write_bytes(elf_bytes(183, b"had_r_128 reconstruct"))
    row = check_row(deployment.context(), "rt.exllamav3-ext")
    assert row.status == "warn"
    assert "no exl3_moe binding" in row.detail


# --- rt.exllamav3-api --------------------------------------------------------------------------


def test_exllamav3_1_4_0_linear_takes_the_plugin_keywords(tmp_path):
    deployment = vcruz305(tmp_path)
    install_exllamav3(deployment.site, "1.4.0", "aarch64")
    assert check_row(deployment.context(), "rt.exllamav3-api").status == "pass"


def test_linear_without_transformers_fix_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    source = deployment.site / "exllamav3/modules/quant/exl3.py"
    text = source.read_text()
    assert "        transformers_fix: bool = False,\n" in text
    source.write_text(text.replace("        transformers_fix: bool = False,\n", ""))
    row = check_row(deployment.context(), "rt.exllamav3-api")
    assert row.status == "fail"
    assert "does not accept transformers_fix" in row.detail


# --- rt.plugin ---------------------------------------------------------------------------------


def test_plugin_distribution_without_entry_point_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    (deployment.site / "vllm_exl3-0.4.1.dist-info/entry_points.txt").unlink()
    row = check_row(deployment.context(), "rt.plugin")
    assert row.status == "fail"
    assert "registers no vllm.general_plugins entry point" in row.detail
    assert f"--target {deployment.site} git+https://github.com/vcruz305/vllm-exl3@v0.3.0" in row.fix


def test_plugin_not_installed_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    shutil.rmtree(deployment.site / "vllm_exl3-0.4.1.dist-info")
    assert (
        check_row(deployment.context(), "rt.plugin").detail == "vllm-exl3 is not installed in the serving environment."
    )


def test_allowlist_without_the_guard_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.environ["VLLM_PLUGINS"] = "vllm_exl3"
    row = check_row(deployment.context(), "rt.plugin")
    assert row.status == "warn"
    assert row.fix == "export VLLM_PLUGINS=vllm_exl3,patch_dsv4"


@pytest.mark.parametrize(
    "allowlist, hint",
    [
        ("", "does not allow vllm_exl3"),
        ("patch_dsv4", "does not allow vllm_exl3"),
        ("patch_dsv4, vllm_exl3", "remove the spaces"),
    ],
)
def test_allowlist_without_the_plugin_fails(tmp_path, allowlist, hint):
    deployment = vcruz305(tmp_path)
    deployment.environ["VLLM_PLUGINS"] = allowlist
    row = check_row(deployment.context(), "rt.plugin")
    assert row.status == "fail"
    assert hint in row.detail
    assert row.fix == "export VLLM_PLUGINS=" + ("patch_dsv4,vllm_exl3" if allowlist else "vllm_exl3,patch_dsv4")


def test_entry_points_not_utf8_fails_without_a_traceback(tmp_path):
    deployment = vcruz305(tmp_path)
    (deployment.site / "vllm_exl3-0.4.1.dist-info/entry_points.txt").write_bytes(
        b"[vllm.general_plugins]\n\xff\xfe=\x80\n"
    )
    row = check_row(deployment.context(), "rt.plugin")
    assert row.status == "fail"
    assert "entry_points.txt is not UTF-8" in row.detail


def test_garbage_metadata_is_read_by_the_directory_name(tmp_path):
    deployment = vcruz305(tmp_path)
    (deployment.site / "vllm_exl3-0.4.1.dist-info/METADATA").write_bytes(b"\x00\xff garbage\n\n::::\n")
    assert check_row(deployment.context(), "rt.plugin").status == "pass"


def test_entry_point_naming_a_missing_package_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    shutil.rmtree(deployment.site / "vllm_exl3")
    row = check_row(deployment.context(), "rt.plugin")
    assert row.status == "fail"
    assert "not on the import path" in row.detail


# --- rt.plugin-features ------------------------------------------------------------------------


def test_plugin_ignoring_the_dtype_policy_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    keys = ("bits", "codebook", "layer_bits", "non_routed_quantization", "mtp_experts", "mtp_experts_start_layer")
    install_plugin(deployment.site, version="0.2.2", source=plugin_source(reads=keys))
    row = check_row(deployment.context(), "rt.plugin-features")
    assert row.status == "fail"
    assert '"non_routed_dtype_policy" (added in 0.2.3)' in row.detail


def test_plugin_that_does_not_compile_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    install_plugin(deployment.site, source=plugin_source() + "\ndef broken(:\n")
    row = check_row(deployment.context(), "rt.plugin-features")
    assert row.status == "fail"
    assert "does not compile (SyntaxError" in row.detail


def test_plugin_features_without_a_pack_are_listed(tmp_path):
    deployment = vcruz305(tmp_path)
    deployment.pack = None
    row = check_row(deployment.context(), "rt.plugin-features")
    assert row.status == "info"
    assert "non_routed_dtype_policy" in row.detail


# --- rt.plugin-native --------------------------------------------------------------------------


def test_native_extension_for_another_python_warns(tmp_path):
    deployment = lna_lab(tmp_path)
    remove_extension(deployment.site, "vllm_exl3_c")
    (deployment.site / extension_name("vllm_exl3_c", "311", "x86_64")).write_bytes(elf_bytes(EM_X86_64))
    row = check_row(deployment.context(), "rt.plugin-native")
    assert row.status == "warn"
    assert "falls back to exllamav3" in row.detail


# --- rt.torch ----------------------------------------------------------------------------------


def test_cpu_torch_fails(tmp_path):
    deployment = vcruz305(tmp_path)
    install_torch(deployment.site, "2.13.0+cpu", cuda=None)
    row = check_row(deployment.context(), "rt.torch")
    assert row.status == "fail"
    assert "CPU-only build" in row.detail
    assert row.fix.startswith(
        f"pip install --no-deps --upgrade --target {deployment.site} --force-reinstall torch==2.13.0"
    )


def test_torch_other_than_the_pin_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    install_torch(deployment.site, "2.12.0+cu130")
    row = check_row(deployment.context(), "rt.torch")
    assert row.status == "warn"
    assert "(torch==2.13.0)" in row.detail


def test_cuda_12_torch_on_gb10_warns(tmp_path):
    deployment = vcruz305(tmp_path)
    install_torch(deployment.site, "2.13.0+cu128", cuda="12.8")
    row = check_row(deployment.context(), "rt.torch")
    assert row.status == "warn"
    assert "the GB10 recipes need CUDA 13" in row.detail


# --- unreadable inputs: every row is a verdict, never an internal error ------------------------


def _garble(deployment):
    for metadata in deployment.site.glob("*.dist-info/METADATA"):
        metadata.write_bytes(b"\xff\xfe\x00garbage\n:::\n")
    for entry_points in deployment.site.glob("*.dist-info/entry_points.txt"):
        entry_points.write_bytes(b"[vllm.general_plugins\n\x80\x81 = =\n")
    (deployment.site / "torch/version.py").write_bytes(b"__version__ = \xff\n")
    (deployment.site / "exllamav3/modules/quant/exl3.py").write_text("class LinearEXL3(:\n")
    (deployment.site / "vllm/utils/flashinfer.py").write_bytes(b"\x00\x01")
    for extension in deployment.site.glob("*.so"):
        extension.write_bytes(b"\x7fEL")


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_garbled_files_never_raise(tmp_path, name):
    deployment = DEPLOYMENTS[name](tmp_path)
    _garble(deployment)
    rows = module_rows(deployment.context(), "rt.")
    assert [r.detail for r in rows if "internal error" in r.detail] == []
    assert {r.id: r.status for r in rows}["rt.exllamav3-ext"] == "fail"


def test_every_install_fix_of_the_command_names_the_target_and_a_served_version(make_tree, tmp_path, monkeypatch):
    """As a user runs it on vLLM 0.34.0 with --site-packages: no fix installs with whichever pip is on PATH, and
    none names flashinfer-python==0.7.3, the pin pip's index does not serve."""
    from tests.conftest import run_cli
    from tests.doctor.synthetic_v41 import SMALL41, build_v41_pack

    pip_index.serve(monkeypatch, tmp_path, ["0.7.2.post1", "0.7.4"])
    tree = make_tree("0.34.0")
    pack = build_v41_pack(tmp_path / "pack", SMALL41)
    result = run_cli("doctor", "--site-packages", tree, "--pack", pack, "--json")
    fixes = [row["fix"] for row in result.json()["checks"] if row["fix"] and "pip " in row["fix"]]
    assert len(fixes) >= 4  # FlashInfer, exllamav3, the plugin, torch
    target = f"pip install --no-deps --upgrade --target {tree} "
    for fix in fixes:
        assert fix.count("pip install") == fix.count(target), fix
    (flashinfer,) = [fix for fix in fixes if "flashinfer-python" in fix]
    assert f"{target}flashinfer-python==0.7.4 (0.7.3 is not on pip's index;" in flashinfer
