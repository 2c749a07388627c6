"""Every patch's examples, run through the engine: BEFORE gives AFTER byte for byte, and AFTER changes nothing."""

from __future__ import annotations

import dataclasses
import types

import pytest

from patch_dsv4.output.verdicts import Verdict
from patch_dsv4.patching.patch import Context
from patch_dsv4.patching.registry import discover_examples, discover_patches
from patch_dsv4.pipeline.judge import judge

CASES = [pytest.param(patch, ex, id=f"{patch.id}:{ex.name}") for patch, ex in discover_examples()]


def _as_example_sees_it(patch, example):
    """The patch with only its edits on the example's file (helpers left out when the example says so)."""
    edits = tuple(
        edit if example.with_helpers else dataclasses.replace(edit, helpers=())
        for edit in patch.edits
        if edit.file == example.file
    )
    return types.SimpleNamespace(id=patch.id, edits=edits)


def _judge(patch, example, text):
    ctx = Context.from_texts(
        {example.file: text},
        vllm_version=example.vllm_version,
        flashinfer_version=example.flashinfer_version,
        flashinfer_source="pinned" if example.flashinfer_version else None,
    )
    judgement = judge(ctx, [_as_example_sees_it(patch, example)], check_fit=False)
    return [o for _, o in judgement.outcomes[patch.id]], judgement.planned.get(example.file)


@pytest.mark.parametrize("patch,example", CASES)
def test_example(patch, example):
    outcomes, planned = _judge(patch, example, example.before)
    assert outcomes, f"{patch.id} has no edit on {example.file}"
    if example.after is None:
        assert planned is None, "the patch changed a file it must leave alone"
        assert example.verdict in {o.verdict for o in outcomes}, [o.detail for o in outcomes]
        return
    assert planned is not None, [o.detail for o in outcomes]
    assert planned.decode() == example.after
    again, planned_again = _judge(patch, example, example.after)
    assert planned_again is None, "patching AFTER changed it"
    assert all(o.verdict in (Verdict.APPLIED, Verdict.UPSTREAM, Verdict.NOT_APPLICABLE) for o in again)


@pytest.mark.parametrize("patch", discover_patches(), ids=lambda p: p.id)
def test_every_patch_has_a_literal_example(patch):
    literal = [ex for p, ex in discover_examples() if p.id == patch.id and ex.after is not None and not ex.derived]
    assert literal, f"{patch.id} needs at least one example whose AFTER is written out literally"
