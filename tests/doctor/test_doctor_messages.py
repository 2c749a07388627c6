"""What doctor says, as a user reads it at 80 columns: its help, and rows that say what is true (issue 40 item 7)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.doctor import pip_index
from tests.doctor.synthetic import build_mixedk_pack
from tests.doctor.synthetic_v41 import SMALL41, build_v41_variant


@pytest.fixture(scope="module")
def tree034(tmp_path_factory):
    from tests.releases import copy_tree, pristine_tree

    return copy_tree(pristine_tree("0.34.0"), tmp_path_factory.mktemp("vllm") / "site-packages")


@pytest.fixture(autouse=True)
def narrow(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    pip_index.offline(monkeypatch)  # the FlashInfer fix asks pip's index: no network here


def rows_of(*args) -> dict:
    result = run_cli("doctor", *args, "--json")
    rows: dict = {}
    for row in result.json()["checks"]:
        rows.setdefault(row["id"], row)
    return rows


def test_help_never_breaks_a_flag_across_lines():
    result = run_cli("doctor", "--help")
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), result.stdout
    assert '"--tensor-parallel-size 8' in result.stdout  # one piece, so it can be copied
    assert not [line for line in lines if line.rstrip().endswith(("-", '"--'))]


def test_with_a_pack_the_context_length_row_says_what_the_pack_lacks(tree034, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")  # its config.json gives no max_position_embeddings
    row = rows_of("--site-packages", tree034, "--pack", pack)["env.alloc-conf"]
    assert row["status"] == "skip" and "nor a pack" not in row["detail"]
    assert row["detail"] == (
        "no --max-model-len in --serve-args, and the pack's config.json has no max_position_embeddings: "
        "the context length is not known here"
    )
    row = rows_of("--site-packages", tree034, "--serve-args", "--max-model-len lots")["env.alloc-conf"]
    assert row["detail"] == "--max-model-len 'lots' is not a number of tokens"
    row = rows_of("--site-packages", tree034)["env.alloc-conf"]
    assert row["detail"].startswith("no --max-model-len in --serve-args and no --pack")


def test_the_ep_filter_row_names_what_the_serve_line_lacks(tree034, tmp_path):
    pack = build_v41_variant(tmp_path / "pack", "good", SMALL41)
    row = rows_of("--site-packages", tree034, "--pack", pack)["v41.ep-filter-draft"]
    assert row["status"] == "pass" and "not all of" not in row["detail"]
    assert row["detail"] == (
        "the serve line has no --enable-expert-parallel, no --enable-ep-weight-filter and no DSpark "
        "--speculative-config: the EP weight filter skips no DSpark draft expert."
    )
    serve = "--enable-expert-parallel --enable-ep-weight-filter"
    row = rows_of("--site-packages", tree034, "--pack", pack, "--serve-args", serve)["v41.ep-filter-draft"]
    assert row["detail"].startswith("the serve line has no DSpark --speculative-config:")


def test_a_pack_without_its_engram_shards_gets_one_fix(tree034, tmp_path):
    """Mia's card: "you still need shards 47 and 48". The numbered shards the pack lacks and the Engram tables
    they would hold are one problem with one remedy, not a re-download of what the repository never had."""
    pack = build_v41_variant(tmp_path / "pack", "no-engram", SMALL41)
    rows = rows_of("--site-packages", tree034, "--pack", pack)
    shards, tables = rows["pack.shards"], rows["v41.engram-tables"]
    assert shards["status"] == tables["status"] == "fail"
    assert "model-00008-of-00008.safetensors is missing" in shards["detail"]
    assert shards["fix"] == tables["fix"] and "hf download" not in shards["fix"]


def test_quiet_fail_lines_fit_80_columns(tree034, tmp_path):
    pack = build_v41_variant(tmp_path / "pack", "no-engram", SMALL41)
    result = run_cli("doctor", "--site-packages", tree034, "--pack", pack, "-q")
    lines = result.stdout.splitlines()
    assert result.code == 1 and all(len(line) <= 80 for line in lines), result.stdout
    assert lines[0].startswith("FAIL  pack.shards: ") and lines[1].startswith("      ")
    assert lines[-1].startswith("doctor: ")
