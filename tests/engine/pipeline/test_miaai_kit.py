"""MiaAI-Lab's kit on real releases: recognised by facts, never a pending verdict on right code, taken over where
it carries one of our fixes (pip's bytes from the release's wheel, as it keeps no backup), left in place where we
have no equivalent.

Kit-edited trees are built by tests/miaai_trees.py from the notes on the kit. The wheel take-over runs offline:
the tool's wheel cache is the tests' (which holds the real vLLM wheels) and pip has no index.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patch_dsv4.releases.release_wheel import unobtainable
from patch_dsv4.tree.environment import locate_vllm, record_digest
from tests import miaai_trees as M
from tests.errors import error_lines
from tests.releases import cache_dir, content_snapshot, wheel


def _said(result) -> str:
    """What a command's errors say, each joined into one line (they are folded to 80 columns)."""
    return "\n".join(error_lines(result.stderr))


DSV4 = "vllm/models/deepseek_v4"


@pytest.fixture
def release_wheels(monkeypatch):
    """The tool fetches into the tests' wheel cache, and pip reaches no index: a wheel not cached is not had."""
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(cache_dir()))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return wheel  # wheel("vllm", v) makes sure the cache holds v's wheel


def _not_record(tree: Path, under: str = "vllm/") -> list[str]:
    """The files under ``under`` that are not byte for byte what pip's RECORD lists."""
    env = locate_vllm(site_packages=tree)
    return sorted(
        rel
        for rel, digest in env.record.items()
        if rel.startswith(under) and (tree / rel).is_file() and record_digest((tree / rel).read_bytes()) != digest
    )


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_exl3_lm_head_leaves_dtype_policy_upstream_and_is_left_in_place(version, make_tree, cli):
    tree = make_tree(version)
    pristine = cli("status", "--site-packages", tree, "--json").verdicts()
    assert M.apply_exl3_lm_head(tree, version).changed == [M.O_PROJ]
    kit_o_proj = (tree / M.O_PROJ).read_bytes()
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts() == pristine  # upstream stays upstream: never pending because of the kit
    dtype = status.patch("dtype-policy")
    assert dtype["verdict"] == "upstream" and "torch.float8_e4m3fn" in dtype["detail"]
    assert "patch_exl3_lm_head.py (MiaAI-Lab kit) edited o_proj.py" in dtype["detail"]
    assert "EXL3 wo_a" in dtype["detail"] and "leaves it in place" in dtype["detail"]
    assert "patch_exl3_lm_head.py" in cli("status", "--site-packages", tree).stdout  # the table names it too
    # nothing is planned in o_proj.py, nor behind the kit's edit
    dry = cli("apply", "--site-packages", tree, "--dry-run")
    assert dry.code == 0 and f"a/{M.O_PROJ}" not in dry.stdout
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    notes = done.json()["notes"]
    kept = f"{M.O_PROJ}: patch_exl3_lm_head.py (MiaAI-Lab kit): left in place, patch-dsv4 has no equivalent of it"
    assert kept in notes
    assert (tree / M.O_PROJ).read_bytes() == kit_o_proj
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert (tree / M.O_PROJ).read_bytes() == kit_o_proj and _not_record(tree) == [M.O_PROJ]


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_sm120_block64_is_taken_over_from_the_wheel(version, make_tree, cli, release_wheels):
    wheel_path = release_wheels("vllm", version)
    tree = make_tree(version)
    pristine = cli("status", "--site-packages", tree, "--json").verdicts()
    run = M.apply_sm120_block64(tree, version)
    assert M.MTP in run.changed and (M.SPARSE_SWA in run.changed) == (version == "0.30.0")
    kit = {rel: (tree / rel).read_bytes() for rel in run.changed}
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts() == pristine
    aux = status.patch("aux-streams")
    (draft,) = [e for e in aux["edits"] if e["file"] == M.MTP]
    assert draft["verdict"] == "foreign" and draft["foreign"] == "patch_sm120_block64.py"
    assert "DSV41_EXL3_SERIAL_STREAMS=1" in draft["detail"] and "takeover --with aux-streams" in aux["detail"]
    wide = status.patch("wide-swa")
    # the text-only window lands on 0.30.0 only (its anchor is 0.30.0's text): named there, the verdict its own
    assert ("patch_sm120_block64.py" in wide["detail"]) == (version == "0.30.0")
    if version == "0.30.0":
        assert "plain causal window" in wide["detail"] and wide["verdict"] == "pending"
    asked = cli("apply", "--site-packages", tree, "--with", "aux-streams")
    assert asked.code == 1 and "another tool's edit" in _said(asked)
    assert f"restores pip's from backups or the vllm=={version} wheel" in _said(asked)
    # dry run: the bytes come from the wheel, named
    before = content_snapshot(tree, "vllm")
    dry = cli("takeover", "--site-packages", tree, "--dry-run", "--json")
    assert dry.code == 0, dry.stderr
    assert f"{M.MTP}: restores pip's bytes from the release wheel {wheel_path}" in " ".join(dry.json()["notes"])
    assert f"a/{M.MTP}" in dry.json()["diff"] and content_snapshot(tree, "vllm") == before
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    assert done.verdicts()["aux-streams"] == "applied"
    saved = [Path(p) for p in done.json()["saved_edits"]]
    assert [p.read_bytes() for p in saved] == [kit[M.MTP]]  # the kit's edit is saved, not lost
    if version == "0.30.0":
        assert (tree / M.SPARSE_SWA).read_bytes() == kit[M.SPARSE_SWA]
        assert any(n.startswith(f"{M.SPARSE_SWA}: patch_sm120_block64.py") for n in done.json()["notes"])
    assert "None if _patch_dsv4_aux_streams_off() else" in (tree / M.MTP).read_text()
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    # each file is pip's bytes, or holds exactly the kit's edit we left: never ours, never a mix
    left = sorted(set(run.changed) - {M.MTP})
    assert _not_record(tree) == left and all((tree / rel).read_bytes() == kit[rel] for rel in left)


def test_a_backup_beside_the_file_is_used_before_the_wheel(make_tree, cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    tree = make_tree("0.30.0")
    pip_mtp = (tree / M.MTP).read_bytes()
    M.apply_sm120_block64(tree, "0.30.0")
    (tree / (M.MTP + ".before-kit")).write_bytes(pip_mtp)  # the user kept one
    assert "restores pip's from their backups" in cli("apply", "--site-packages", tree, "--with", "aux-streams").stderr
    dry = cli("takeover", "--site-packages", tree, "--dry-run", "--json")
    assert f"{M.MTP}: restores pip's bytes from mtp.py.before-kit" in " ".join(dry.json()["notes"])
    assert cli("takeover", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0 and (tree / M.MTP).read_bytes() == pip_mtp


def test_no_wheel_to_be_had_keeps_the_reinstall_advice(make_tree, cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as a private image or a host without network
    tree = make_tree("0.30.0")
    M.apply_sm120_block64(tree, "0.30.0")
    before = content_snapshot(tree, "vllm")
    refused = cli("takeover", "--site-packages", tree)
    err = " ".join(line.removeprefix("patch-dsv4:").strip() for line in refused.stderr.splitlines())
    assert refused.code == 1 and "Traceback" not in err
    assert "why: no backup beside it holds what pip installed" in err
    assert "the release wheel cannot serve: cannot fetch vllm==0.30.0 with pip: No matching distribution" in err
    assert "next: pip install --no-deps --force-reinstall" in err and "vllm==0.30.0, then patch-dsv4 apply" in err
    assert content_snapshot(tree, "vllm") == before


def test_a_wheel_of_another_build_is_refused_before_anything_is_written(make_tree, cli, monkeypatch, tmp_path):
    """The cache holds a file named as 0.30.0's wheel whose members are 0.31.0's: RECORD's sha256 refuses them."""
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    os.symlink(wheel("vllm", "0.31.0"), cache / "wheels" / "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    tree = make_tree("0.30.0")
    M.apply_sm120_block64(tree, "0.30.0")
    before = content_snapshot(tree, "vllm")
    refused = cli("takeover", "--site-packages", tree)
    assert refused.code == 1
    assert f"{M.MTP} is not what pip installed here (its sha256 differs from RECORD)" in _said(refused)
    assert content_snapshot(tree, "vllm") == before and not (tree / ".patch-dsv4").exists()


def test_a_local_build_has_no_wheel():
    assert "local build" in unobtainable("0.1.dev20904+g179dd0fa9")
    assert unobtainable("0.30.0") is None and unobtainable("0.31.0rc1") is None


@pytest.mark.parametrize("script", [M.H2D_STAGE, M.MEMORY_LOG, M.SM12X_VISION])
def test_edits_of_files_no_patch_reads_change_nothing(script, make_tree, cli):
    tree = make_tree("0.30.0")
    pristine = cli("status", "--site-packages", tree, "--json").verdicts()
    run = M.SCRIPTS[script](tree, "0.30.0")
    kit = {rel: (tree / rel).read_bytes() for rel in run.changed}
    assert cli("status", "--site-packages", tree, "--json").verdicts() == pristine
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0 and "nothing to take over" in " ".join(done.json()["notes"])
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert _not_record(tree) == sorted(run.changed) and all((tree / r).read_bytes() == d for r, d in kit.items())


def test_the_whole_kit_on_0_30_0(make_tree, cli, release_wheels):
    release_wheels("vllm", "0.30.0")
    tree = make_tree("0.30.0")
    runs = M.run_kit(tree, "0.30.0")
    changed = sorted({rel for run in runs for rel in run.changed})
    kit = {rel: (tree / rel).read_bytes() for rel in changed}
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts()["dtype-policy"] == "upstream" and status.verdicts()["wide-swa"] == "pending"
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    left = sorted(set(changed) - {M.MTP})
    assert _not_record(tree) == left and all((tree / rel).read_bytes() == kit[rel] for rel in left)
    assert _not_record(tree, DSV4 + "/") == [M.O_PROJ]


def test_the_kit_on_the_nightly_layout(make_tree, cli, release_wheels):
    """On deepseek_v4_1/ the kit's switch stands in V4.1's model too, beside its EXL3 loading: aux-streams is
    foreign there, and no take-over restores that file (it would remove the EXL3 loading); apply leaves it."""
    from tests.v41_trees import nightly_layout

    tree = nightly_layout(make_tree("0.30.0"))
    runs = M.run_kit(tree, "0.30.0")
    assert all(M.V41_MODEL in run.changed for run in runs[:2]) and runs[1].exit_code == 0
    status = cli("status", "--site-packages", tree, "--json")
    (v41,) = [e for e in status.patch("aux-streams")["edits"] if e["file"] == M.V41_MODEL]
    assert v41["verdict"] == "foreign" and v41["foreign"] == "patch_sm120_block64.py"
    assert "patch_exl3_lm_head.py (MiaAI-Lab kit) edited model.py (DeepseekV4Model.load_weights)" in v41["detail"]
    wide = [e for e in status.patch("wide-swa")["edits"] if "nightly" in e["label"] and "V4.1" in e["label"]]
    assert wide[0]["verdict"] == "pending" and "patch_sm120_block64.py" in wide[0]["detail"]
    assert status.verdicts()["dtype-policy"] == "upstream"
    # the kit's V4.1 slice mapping is never taken for upstream's, nor written behind
    (slices,) = [e for e in status.patch("exl3-wo-a-slices")["edits"] if e["file"] == M.V41_MODEL]
    assert slices["verdict"] == "foreign" and slices["foreign"] == "patch_exl3_lm_head.py"
    asked = cli("apply", "--site-packages", tree, "--with", "exl3-wo-a-slices")
    assert asked.code == 1 and "another tool's edit" in _said(asked)
    assert f"next: patch-dsv4 apply --site-packages {tree} (the other tool's edits stay" in _said(asked)
    before = content_snapshot(tree, "vllm")
    refused = cli("takeover", "--site-packages", tree)
    assert refused.code == 1 and f"cannot take over {M.V41_MODEL}" in _said(refused)
    assert "patch_exl3_lm_head.py (MiaAI-Lab kit)'s edit" in _said(refused) and "never removes" in _said(refused)
    assert content_snapshot(tree, "vllm") == before
    done = cli("apply", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    assert M.V41_MODEL not in done.json()["changed_files"] and M.MTP not in done.json()["changed_files"]
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0 and content_snapshot(tree, "vllm") == before


@pytest.mark.parametrize(
    ("body", "counts"),
    [
        ("use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn", True),  # vLLM 0.30.0-0.33.0
        ('w = getattr(wo_a, "weight", None)\nuse_fp8 = w is not None and w.dtype == torch.float8_e4m3fn', True),
        ("w = wo_a.weight\nuse_fp8 = w.dtype == torch.float8_e4m3fn", True),
        ("w = wo_b.weight\nuse_fp8 = w.dtype == torch.float8_e4m3fn", False),  # another module's weight
        ('w = getattr(wo_a, "weight_scale", None)\nuse_fp8 = w.dtype == torch.float8_e4m3fn', False),
        ("use_fp8 = wo_a.weight.dtype == torch.bfloat16", False),
    ],
)
def test_the_dtype_probe_follows_a_name_bound_to_wo_a_weight(body, counts):
    """dtype-policy's evidence in the shared op: a comparison of wo_a's weight dtype with FP8, however bound."""
    import ast

    from patch_dsv4.patches.dtype_policy import _compares_wo_a_dtype_with_fp8

    assert _compares_wo_a_dtype_with_fp8(ast.parse(body)) is counts


def test_a_local_build_keeps_the_reinstall_advice_with_its_reason(make_tree, cli, release_wheels):
    """An image's own build (a local version) has no wheel on any index: nothing is fetched, nothing written."""
    tree = make_tree("0.30.0")
    M.apply_sm120_block64(tree, "0.30.0")
    local = "0.1.dev20904+g179dd0fa9"
    dist_info = tree / f"vllm-{local}.dist-info"
    (tree / "vllm-0.30.0.dist-info").rename(dist_info)
    metadata = (dist_info / "METADATA").read_text().replace("Version: 0.30.0\n", f"Version: {local}\n", 1)
    (dist_info / "METADATA").unlink()
    (dist_info / "METADATA").write_text(metadata)
    status = cli("status", "--site-packages", tree, "--json")
    assert status.json()["vllm_version"] == local
    before = content_snapshot(tree, "vllm")
    refused = cli("takeover", "--site-packages", tree)
    err = " ".join(line.removeprefix("patch-dsv4:").strip() for line in refused.stderr.splitlines())
    assert refused.code == 1 and f"vLLM {local} is a local build (+g179dd0fa9): no index serves its wheel" in err
    assert f"next: pip install --no-deps --force-reinstall --upgrade --target {tree} vllm=={local}" in err
    assert content_snapshot(tree, "vllm") == before
