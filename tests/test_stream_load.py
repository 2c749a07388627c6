"""stream-load on the real releases, and its injected generator run on CPU torch."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.conftest import RELEASE_PARAMS
from tests.injected import load_function
from tests.releases import hand_edit, rewrite_record, stat_snapshot

EXPECTED = {
    "0.28.0": "not-applicable",
    "0.29.0": "not-applicable",
    "0.30.0": "pending",
    "0.31.0": "pending",
    "0.32.0": "pending",
    "0.33.0": "upstream",
}
HELPER = "_patch_dsv4_stream_language_model_first"


@pytest.mark.parametrize("reformatted", [False, True], ids=["pristine", "reformatted"])
@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_verdict(version, reformatted, make_tree, cli):
    tree = make_tree(version, reformatted=reformatted)
    result = cli("status", "--site-packages", tree, "--json")
    assert result.code == 0, result.stderr
    patch = result.patch("stream-load")
    assert patch["verdict"] == EXPECTED[version], patch
    if EXPECTED[version] == "upstream":
        assert "stream_language_model_first" in patch["detail"]


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0"])
def test_only_the_vision_class_method_changes(version, make_tree, cli):
    """Not the deepseek_v41 look-alike, not the nvidia/vl_model.py shim, not another method."""
    tree = make_tree(version)
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--only", "stream-load", "--json")
    assert result.code == 0, result.stderr
    after = stat_snapshot(tree)
    changed = {f for f in after if before.get(f) != after[f] and not f.startswith(".patch-dsv4")}
    assert changed == {VL_MODEL}
    text = (tree / VL_MODEL).read_text()
    assert text.count(f"{HELPER}(mapped)") == 1
    assert "iter(sorted(mapped" not in text
    look_alike = tree / "vllm/models/deepseek_v41/nvidia/vl_model.py"
    assert HELPER not in look_alike.read_text()


def test_recognised_as_ours_without_state(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    shutil.rmtree(tree / ".patch-dsv4")
    result = cli("status", "--site-packages", tree, "--json")
    assert result.verdicts()["stream-load"] == "applied"
    assert result.json()["state"] == "none"


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0"])
def test_changed_anchor_is_drifted_and_nothing_written(version, make_tree, cli):
    tree = make_tree(version)
    path = tree / VL_MODEL
    hand_edit(path, path.read_text().replace("key=lambda x: x[0]", "key=lambda item: item[0]"))
    rewrite_record(tree, [VL_MODEL])  # a release that really ships this code
    before = stat_snapshot(tree)
    status = cli("status", "--site-packages", tree, "--json")
    patch = status.patch("stream-load")
    assert patch["verdict"] == "drifted"
    (edit,) = patch["edits"]
    assert "iter(sorted(mapped, key=lambda x: x[0]))" in edit["expected"]
    assert "lambda item: item[0]" in edit["found"]
    applied = cli("apply", "--site-packages", tree)
    assert applied.code == 1
    assert "stream-load is drifted" in applied.stderr
    assert len(applied.stderr.strip().splitlines()) == 1
    assert stat_snapshot(tree) == before


# -- the injected generator, executed on CPU torch ---------------------------------
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    from tests.releases import copy_tree, pristine_tree
    from tests.conftest import run_cli

    tree = copy_tree(pristine_tree("0.30.0"), tmp_path_factory.mktemp("stream") / "sp")
    assert run_cli("apply", "--site-packages", tree, "--only", "stream-load").code == 0
    return load_function(tree / VL_MODEL, HELPER)


def _checkpoint():
    """(name, tensor) pairs as a sharded loader yields them: models interleaved."""
    names = []
    for layer in range(6):
        names.append(f"language_model.model.layers.{layer}.attn.wq.weight")
        if layer % 2:
            names.append(f"vision.blocks.{layer}.qkv.weight")
        names.append(f"language_model.model.layers.{layer}.ffn.gate.weight")
        if layer == 3:
            names.append("aligner.proj.weight")
            names.append("image_newline")
    return names


def test_every_tensor_once_language_model_first(stream):
    names = _checkpoint()
    source = [(n, torch.full((4,), float(i))) for i, n in enumerate(names)]
    out = list(stream(iter(source)))
    assert sorted(n for n, _ in out) == sorted(names)
    lm = [n for n in names if n.startswith("language_model.")]
    assert [n for n, _ in out[: len(lm)]] == lm
    rest = [n for n, _ in out[len(lm) :]]
    assert set(rest) == set(names) - set(lm)
    # each deferred module arrives as one group (the child sees it contiguously)
    heads = [n.split(".", 1)[0] for n in rest]
    assert heads == sorted(heads, key=heads.index)
    for name, tensor in out:
        assert tensor[0].item() == float(names.index(name))


def test_language_model_tensor_freed_before_next_pull(stream):
    refs = []

    def make(i):
        tensor = torch.zeros(1024)
        refs.append(weakref.ref(tensor))
        return f"language_model.layers.{i}.w", tensor

    def source():
        for i in range(4):
            yield make(i)  # this frame keeps no reference to what it yields

    gen = stream(source())
    item = next(gen)
    del item
    gc.collect()
    assert refs[0]() is None, "the generator kept the yielded tensor alive"
    assert len(list(gen)) == 3


def test_deferred_tensors_share_no_storage(stream):
    source = [
        ("vision.patch_embed.weight", torch.arange(8.0)),
        ("language_model.model.embed.weight", torch.arange(8.0)),
        ("aligner.proj.weight", torch.arange(8.0)),
    ]
    originals = {n: t for n, t in source}
    out = dict(stream(iter(list(source))))
    for name in ("vision.patch_embed.weight", "aligner.proj.weight"):
        assert out[name].untyped_storage().data_ptr() != originals[name].untyped_storage().data_ptr()
        assert torch.equal(out[name], originals[name])
    lm = "language_model.model.embed.weight"
    assert out[lm] is originals[lm]
