"""stream-load's injected generator, imported from the patch module and run on CPU torch (skipped alone without
torch)."""

from __future__ import annotations

import gc
import weakref

import pytest

from patch_dsv4.patches import stream_load

torch = pytest.importorskip("torch")


stream = stream_load._patch_dsv4_stream_language_model_first


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


def test_every_tensor_once_language_model_first():
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


def test_language_model_tensor_freed_before_next_pull():
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


def test_deferred_tensors_share_no_storage():
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
