"""Every patch's BEFORE/AFTER examples: the edit gives AFTER, and on AFTER changes nothing."""

from __future__ import annotations

import pytest

from patch_dsv4.patch import Context
from patch_dsv4.registry import discover_examples
from patch_dsv4.verdicts import Verdict

CASES = [pytest.param(patch, ex, id=f"{patch.id}:{ex.name}") for patch, ex in discover_examples()]


def _judge(patch, example, text):
    ctx = Context.from_texts(
        {example.file: text},
        vllm_version=example.vllm_version,
        flashinfer_version=example.flashinfer_version,
        flashinfer_source="pinned" if example.flashinfer_version else None,
    )
    outcomes = []
    for edit in patch.edits(ctx):
        if edit.file == example.file:
            outcome = edit.evaluate(ctx, text)
            outcomes.append(outcome)
            if outcome.new_text is not None:
                text = outcome.new_text
    return outcomes, text


@pytest.mark.parametrize("patch,example", CASES)
def test_example(patch, example):
    outcomes, text = _judge(patch, example, example.before)
    assert outcomes, f"{patch.id} has no edit on {example.file}"
    if example.after is None:
        assert text == example.before
        assert example.verdict in {o.verdict for o in outcomes}, [o.detail for o in outcomes]
        return
    assert text == example.after
    again, text_again = _judge(patch, example, example.after)
    assert text_again == example.after, "patching AFTER changed it"
    assert all(o.verdict in (Verdict.APPLIED, Verdict.UPSTREAM, Verdict.NOT_APPLICABLE) for o in again)
