"""dense-exl3 and exl3-wo-a-slices on the real releases: opt-in, applied when asked, composed with dtype-policy,
and the way out of lna-lab's own scripts (recipe trees built by tests/recipe_trees.py)."""

from __future__ import annotations

import pytest

from patch_dsv4.patches import dense_exl3 as D
from tests import recipe_trees as R
from tests.releases import content_snapshot, hand_edit, rewrite_record

VERSIONS = ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
OPT_INS = ("dense-exl3", "exl3-wo-a-slices")
CLOSURES = (
    "compressor_kv_score runs an EXL3 fused_wkv_wgate",
    "indexer_compressor_kv_score runs an EXL3 fused_wkv_wgate",
)
KV_CLASS = D.KV_SCORE_EDIT.label
QUANT, O_PROJ = D.DenseExl3.edits[0].label, D.DenseExl3.edits[1].label


def _verdicts(cli, tree) -> dict[str, str]:
    return cli("status", "--site-packages", tree, "--json").verdicts()


@pytest.mark.parametrize("version", VERSIONS)
def test_opt_in_until_asked_then_applied_and_reverted(version, make_tree, cli):
    tree = make_tree(version)
    pristine = content_snapshot(tree)
    before = _verdicts(cli, tree)
    assert all(before[pid] == "opt-in" for pid in OPT_INS)
    assert cli("apply", "--site-packages", tree).code == 0
    assert all(_verdicts(cli, tree)[pid] == "opt-in" for pid in OPT_INS)  # a plain apply leaves them alone
    done = cli("apply", "--site-packages", tree, "--with", "dense-exl3", "--with", "exl3-wo-a-slices")
    assert done.code == 0, done.stderr
    after = _verdicts(cli, tree)
    assert all(after[pid] == "applied" for pid in OPT_INS)
    if version in ("0.28.0", "0.29.0"):  # dense-exl3's call-site edit and dtype-policy's _o_proj stand together
        assert after["dtype-policy"] == "applied" and after["loader-skips"] == "applied"
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 0, verify.stdout
    again = cli("apply", "--site-packages", tree, "--json")  # remembered in the state: nothing more to do
    assert again.code == 0 and again.json()["changed_files"] == []
    assert cli("revert", "--site-packages", tree).code == 0
    assert content_snapshot(tree) == pristine
    assert all(_verdicts(cli, tree)[pid] == "opt-in" for pid in OPT_INS)


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_lna_lab_tree_status_takeover_verify(version, make_tree, cli):
    """lna-lab's two dense-EXL3 scripts, as its Dockerfile runs them: named, taken over, verified, reverted."""
    tree = make_tree(version)
    pristine = content_snapshot(tree)
    changed = R.apply_dense_exl3(tree, version) + R.apply_attention_compressor(tree, version)
    status = cli("status", "--site-packages", tree, "--json")
    dense, slices = status.patch("dense-exl3"), status.patch("exl3-wo-a-slices")
    assert dense["verdict"] == "opt-in" and "patch_dsv4_dense_exl3.py" in dense["detail"]
    assert "takeover --with dense-exl3" in dense["detail"]
    scripts = {e["foreign"] for e in dense["edits"] if e["verdict"] == "foreign"}
    assert scripts == {"patch_dsv4_dense_exl3.py", "patch_dsv4_attention_compressor_exl3.py"}
    assert slices["verdict"] == "opt-in" and "slice.1 also matches slice.10" in slices["detail"]
    assert status.patch("dtype-policy")["verdict"] == "foreign"
    assert "takeover --with dense-exl3" in status.patch("dtype-policy")["detail"]
    taken = cli("takeover", "--site-packages", tree, "--with", "dense-exl3", "--with", "exl3-wo-a-slices", "--json")
    assert taken.code == 0, taken.stderr
    assert set(changed) <= set(taken.json()["changed_files"])  # restored from pip's bytes, then patched
    assert len(taken.json()["saved_edits"]) == len(set(changed))  # each edited file saved first
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 0, verify.stdout
    assert all(verify.verdicts()[pid] == "applied" for pid in OPT_INS)
    assert cli("revert", "--site-packages", tree).code == 0
    after = content_snapshot(tree)
    assert {rel: sha for rel, sha in after.items() if rel in pristine} == pristine  # lna's backups stay beside


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_lna_lab_script_on_new_releases_leaves_the_compressor_edit(version, make_tree, cli):
    """On 0.31+ the script writes compressor.py, then refuses: that edit is named and taken over too."""
    tree = make_tree(version)
    with pytest.raises(R.RecipeRefuses) as refused:
        R.apply_dense_exl3(tree, version)
    assert list(refused.value.written) == [R.COMPRESSOR]
    dense = cli("status", "--site-packages", tree, "--json").patch("dense-exl3")
    assert dense["verdict"] == "opt-in" and "vllm_config.quant_config" in dense["detail"]
    taken = cli("takeover", "--site-packages", tree, "--with", "dense-exl3")
    assert taken.code == 0, taken.stderr
    assert _verdicts(cli, tree)["dense-exl3"] == "applied"
    assert cli("verify", "--site-packages", tree).code == 0


def test_the_v1_helper_renamed_by_v2_is_named_with_its_broken_fallback(make_tree, cli):
    tree = make_tree("0.30.0")
    R.apply_attention_compressor(tree, "0.30.0", helper="v1")
    R.apply_attention_compressor(tree, "0.30.0", helper="v2")
    dense = cli("status", "--site-packages", tree, "--json", "-v").patch("dense-exl3")
    assert "_lna_kv_score_v2" in dense["detail"] and "a BF16 compressor fails" in dense["detail"]


def _edits(cli, tree) -> dict[str, dict]:
    """dense-exl3's edits as status reports them, by label."""
    return {e["label"]: e for e in cli("status", "--site-packages", tree, "--json", "-v").patch("dense-exl3")["edits"]}


def test_034_the_read_moved_into_the_class_and_one_edit_is_there(make_tree, cli):
    edits = _edits(cli, make_tree("0.34.0"))
    assert {label: e["verdict"] for label, e in edits.items()} == {
        QUANT: "pending",
        O_PROJ: "pending",
        CLOSURES[0]: "not-applicable",
        CLOSURES[1]: "not-applicable",
        KV_CLASS: "pending",
    }
    for closure in CLOSURES:  # followed from the closure's call into the class's forward: the read is there
        detail = edits[closure]["detail"]
        assert "attention.py:DeepseekV4Attention._run_parallel_input_projections" in detail
        assert "-> vllm/models/deepseek_v4/compressor.py:DeepseekV4CompressorKVScoreLinear.forward" in detail
        assert "reads self.weight" in detail


def test_033_has_no_such_class_and_the_closures_read_the_weight(make_tree, cli):
    edits = _edits(cli, make_tree("0.33.0"))
    assert edits[KV_CLASS]["verdict"] == "not-applicable"
    assert [edits[c]["verdict"] for c in CLOSURES] == ["pending", "pending"]


def test_034_v41_compressor_shares_the_patched_class_and_is_left_alone(make_tree, cli):
    tree = make_tree("0.34.0")
    v41 = tree / "vllm/models/deepseek_v41/compressor.py"
    before = v41.read_bytes()
    assert b"from vllm.models.deepseek_v4.compressor import DeepseekV4CompressorKVScoreLinear" in before
    done = cli("apply", "--site-packages", tree, "--with", "dense-exl3", "--json")
    assert done.code == 0, done.stderr
    assert sorted(done.json()["changed_files"]) == [
        "vllm/models/deepseek_v4/attention.py",
        "vllm/models/deepseek_v4/compressor.py",
    ]
    assert v41.read_bytes() == before  # its compressor keeps quant_config=None: V4.1 packs are not carried


# Shapes no release has, written into a copy of 0.34.0 (re-released: RECORD matches them).
KV_READ = "        return torch.mm(input_, self.weight.T, out_dtype=torch.float32)\n"
KV_CLASS_LINE = "class DeepseekV4CompressorKVScoreLinear(MergedColumnParallelLinear):\n"
SHAPES = {
    # the read moved into a module-level helper the forward calls: still a read on the forward path
    "helper-reads-weight": (
        D.COMPRESSOR,
        [
            (KV_READ, "        return _kv_score_mm(self, input_)\n"),
            (
                KV_CLASS_LINE,
                "def _kv_score_mm(layer, x):\n"
                "    return torch.mm(x, layer.weight.T, out_dtype=torch.float32)\n\n\n" + KV_CLASS_LINE,
            ),
        ],
    ),
    # the read moved into a method of the class
    "method-reads-weight": (
        D.COMPRESSOR,
        [
            (
                KV_READ,
                "        return self._mm_fp32(input_)\n\n"
                "    def _mm_fp32(self, x):\n"
                "        return torch.mm(x, self.weight.T, out_dtype=torch.float32)\n",
            )
        ],
    ),
    # the forward hands the work to the quant method (an EXL3 pack's runs its shards): fixed
    "forward-dispatches": (
        D.COMPRESSOR,
        [(KV_READ, "        return self.quant_method.apply(self, input_, None).float()\n")],
    ),
    # the class drops its forward: nn.Module calls the base's, ColumnParallelLinear.forward, which dispatches
    "forward-inherited": (
        D.COMPRESSOR,
        [("    def forward(self, input_: torch.Tensor) -> torch.Tensor:\n" + KV_READ, "")],
    ),
    # the closure no longer calls the module nor reads the weight: the old shape is gone, nothing is found
    "closure-calls-something-else": (
        D.ATTENTION,
        [
            (
                "return compressor.fused_wkv_wgate(hidden_states)",
                "return compressor.project_kv_score(hidden_states)",
            )
        ],
    ),
}


def _shaped(make_tree, name):
    tree = make_tree("0.34.0")
    rel, replacements = SHAPES[name]
    text = (tree / rel).read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    hand_edit(tree / rel, text)
    rewrite_record(tree, [rel])
    return tree


@pytest.mark.parametrize("shape", ["helper-reads-weight", "method-reads-weight"])
def test_a_forward_that_reads_weight_through_a_call_is_not_upstream(shape, make_tree, cli):
    tree = _shaped(make_tree, shape)
    edits = _edits(cli, tree)
    assert edits[KV_CLASS]["verdict"] == "drifted"  # the anchor is gone, the read is not
    for closure in CLOSURES:
        assert edits[closure]["verdict"] == "drifted", edits[closure]["detail"]
        assert "reads layer.weight" in edits[closure]["detail"] or "reads self.weight" in edits[closure]["detail"]
        assert "no edit of dense-exl3 is there" in edits[closure]["detail"]
    refused = cli("apply", "--site-packages", tree, "--with", "dense-exl3")
    assert refused.code == 1


@pytest.mark.parametrize("shape", ["forward-dispatches", "forward-inherited"])
def test_a_forward_that_dispatches_to_the_quant_method_is_upstream(shape, make_tree, cli):
    tree = _shaped(make_tree, shape)
    edits = _edits(cli, tree)
    assert edits[KV_CLASS]["verdict"] == "upstream"
    assert "DeepseekV4CompressorKVScoreLinear.forward reads no .weight" in edits[KV_CLASS]["detail"]
    where = {
        "forward-dispatches": "compressor.py:DeepseekV4CompressorKVScoreLinear.forward",
        "forward-inherited": "linear.py:ColumnParallelLinear.forward",
    }
    assert where[shape] in edits[KV_CLASS]["detail"]
    for closure in CLOSURES:  # both classes the compressor may build (CPU's and the GPUs') dispatch
        assert edits[closure]["verdict"] == "upstream", edits[closure]["detail"]
        assert "linear.py:ColumnParallelLinear.forward" in edits[closure]["detail"]
    assert edits[QUANT]["verdict"] == edits[O_PROJ]["verdict"] == "pending"
    compressor = (tree / D.COMPRESSOR).read_text()
    done = cli("apply", "--site-packages", tree, "--with", "dense-exl3")
    assert done.code == 0, done.stderr
    assert cli("verify", "--site-packages", tree).code == 0
    patched = (tree / D.COMPRESSOR).read_text()
    assert "_patch_dsv4_exl3_kv_score" not in patched and "_patch_dsv4_compressor_quant_config(" in patched
    assert patched != compressor


def test_a_closure_without_the_old_shape_is_drifted_not_upstream(make_tree, cli):
    edits = _edits(cli, _shaped(make_tree, "closure-calls-something-else"))
    assert edits[CLOSURES[0]]["verdict"] == "drifted"
    assert edits[CLOSURES[1]]["verdict"] == "not-applicable"  # the indexer's closure still calls the module
    assert edits[KV_CLASS]["verdict"] == "pending"
