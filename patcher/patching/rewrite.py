"""Rewriting: the files as the pending edits of a judgement write them, proven idempotent.

A function of a judgement's outcomes (each edit's) and the Context it read (nothing is judged again, nothing is
written): judging gives ``planned`` with it, planning writes the files of the patches it chose. It knows edits and
outcomes, not the pipeline's values: the steps stand on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from patch_dsv4.output.errors import TransformBug
from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patching.patch import Context, Edit


def plan_files(
    ctx: Context, outcomes: dict[str, list[tuple[Edit, Outcome]]], files: Iterable[str], patch_ids: set[str]
) -> dict[str, bytes]:
    """The files as the pending edits of ``patch_ids`` write them (encoded as stored), proven idempotent.

    Planned from a judgement as it stands (``outcomes``: patch id -> its edits' outcomes; ``files``: every edited
    file, as ``ctx`` read it): nothing is judged again.
    """
    outcomes = {pid: pairs for pid, pairs in outcomes.items() if pid in patch_ids}
    texts = {path: ctx.read(path) for path in files}
    planned_text = _rewrite(outcomes, texts)
    _prove_idempotent(ctx, outcomes, planned_text)
    return {path: ctx.source(path).encode(text) for path, text in planned_text.items()}


def _rewrite(outcomes: dict[str, list[tuple[Edit, Outcome]]], texts: dict[str, str | None]) -> dict[str, str]:
    """Each file with pending edits, as they write it: one libcst parse and one codegen per file."""
    pending: dict[str, list[tuple[Edit, Outcome]]] = {}
    for pairs in outcomes.values():
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.PENDING:
                pending.setdefault(edit.file, []).append((edit, outcome))
    if not pending:
        return {}
    planned = {}
    for path, edits in pending.items():
        module = _cst_module(texts[path])
        for edit, outcome in edits:
            module = edit.rewrite(module, outcome)
        code = module.code  # one codegen: it costs as much as the parse
        if code != texts[path]:
            planned[path] = code
    return planned


@lru_cache(maxsize=8)
def _cst_module(text: str):
    """The libcst tree of ``text`` (immutable, so shared by the runs of one process that plan the same file)."""
    import libcst as cst

    return cst.parse_module(text)


def _prove_idempotent(ctx: Context, outcomes: dict[str, list[tuple[Edit, Outcome]]], planned: dict[str, str]) -> None:
    """Each planned file parses, and every pending edit finds itself applied there (a second run changes nothing)."""
    for path, text in planned.items():
        try:
            ctx.parse(text)
        except SyntaxError as exc:
            raise TransformBug(f"the planned {path} does not parse", f"{exc.msg} at line {exc.lineno}") from None
        for patch_id, pairs in outcomes.items():
            for edit, first in pairs:
                if edit.file != path or first.verdict is not Verdict.PENDING:
                    continue
                again = edit.evaluate(ctx, text)
                if again.verdict is not Verdict.APPLIED:
                    raise TransformBug(
                        f"patch {patch_id} is not idempotent on {path}",
                        f"run again on its own output, {edit.label!r} gives {again.verdict.value}, not applied",
                        "report this bug; nothing was written",
                    )
