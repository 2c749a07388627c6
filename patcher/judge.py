"""Judging: every edit's verdict on a tree, and the files as the pending edits would leave them.

Pure functions over a :class:`patch_dsv4.patch.Context`: nothing here writes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patch_dsv4.edits import ReplaceStatements
from patch_dsv4.errors import TransformBug
from patch_dsv4.fingerprint import find_scope
from patch_dsv4.patch import Context, Edit, Patch
from patch_dsv4.resolve import check_injected, local_names
from patch_dsv4.verdicts import EditReport, Outcome, PatchReport, Verdict, combine


@dataclass
class Judgement:
    """Every edit's outcome, the files as read, and the files as the pending edits would write them."""

    outcomes: dict[str, list[tuple[Edit, Outcome]]]  # patch id -> its edits, in order
    originals: dict[str, bytes | None]  # every edited file as read
    planned: dict[str, bytes] = field(default_factory=dict)  # only files that change, encoded as stored
    reads: dict[str, set[str]] = field(default_factory=dict)  # patch id -> every file its judgement read

    def patch_files(self, patch_id: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(edit.file for edit, _ in self.outcomes[patch_id]))


def _check_names(ctx: Context, edit: Edit, text: str) -> list[str]:
    scope_names: set[str] = set()
    if isinstance(edit, ReplaceStatements):
        scope = find_scope(ctx.parse(text), edit.scope.cls, edit.scope.func)
        if scope is not None:
            scope_names = local_names(scope)
    return check_injected(ctx, edit.file, edit.injected_code(), scope_names)


def judge(ctx: Context, patches: list[Patch], trust_unrecorded: bool = False) -> Judgement:
    """Run every edit in order, each on the text the previous ones planned for its file.

    A patch is never judged from a file that cannot be read as source, nor
    (unless ``trust_unrecorded``) from a file that differs from what pip
    installed: its edits are reported drifted, naming the file. The one
    exception is its own edit target when the anchor (or our edit) is found
    there: a hand-changed target is refused when written, not when judged.
    """
    outcomes: dict[str, list[tuple[Edit, Outcome]]] = {}
    originals: dict[str, bytes | None] = {}
    current: dict[str, str | None] = {}
    reads: dict[str, set[str]] = {}
    for patch in patches:
        pairs: list[tuple[Edit, Outcome]] = []
        before = dict(current)
        with ctx.recording() as read:
            for edit in patch.edits(ctx):
                if edit.file not in current:
                    current[edit.file] = before[edit.file] = ctx.read(edit.file)
                    originals[edit.file] = ctx.raw(edit.file)
                outcome = edit.evaluate(ctx, current[edit.file])
                if outcome.verdict is Verdict.PENDING:
                    problems = _check_names(ctx, edit, current[edit.file] or "")
                    if problems:
                        outcome = Outcome.drifted(
                            f"{edit.label}: the injected code does not fit this release: " + "; ".join(problems)
                        )
                    else:
                        current[edit.file] = outcome.new_text
                pairs.append((edit, outcome))
        reads[patch.id] = read
        pairs = _untrusted_to_drifted(ctx, pairs, read, trust_unrecorded)
        # Each pending edit's text holds the ones before it: a file ends as its last pending edit left it.
        for edit, outcome in pairs:
            current[edit.file] = before[edit.file]
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.PENDING:
                current[edit.file] = outcome.new_text
        outcomes[patch.id] = pairs
    planned = {}
    for path, text in current.items():
        source = ctx.source(path)
        if text is None or source is None or text == source.text:
            continue
        planned[path] = source.encode(text)
    judgement = Judgement(outcomes, originals, planned, reads)
    _prove_idempotent(ctx, judgement, current)
    return judgement


def _untrusted_to_drifted(ctx, pairs, read, trust_unrecorded):
    own = {edit.file for edit, _ in pairs}
    evidence = [
        (rel, p) for rel in sorted(read - own) if (p := ctx.problem(rel)) is not None and (p.hard or not trust_unrecorded)
    ]
    out = []
    for edit, outcome in pairs:
        problem = ctx.problem(edit.file)
        blocking = list(evidence)
        if problem is not None and (problem.hard or not trust_unrecorded):
            if problem.hard or outcome.verdict not in (Verdict.PENDING, Verdict.APPLIED):
                blocking.insert(0, (edit.file, problem))
        if blocking:
            rel, first = blocking[0]
            outcome = Outcome.drifted(
                f"{edit.label}: cannot be judged: {first.why}",
                expected=f"{rel} as the vLLM release installed it",
                found=first.why,
            )
        out.append((edit, outcome))
    return out


def _prove_idempotent(ctx: Context, judgement: Judgement, planned_text: dict[str, str | None]) -> None:
    """Each planned file parses, and running every edit on it again changes nothing."""
    for path in judgement.planned:
        text = planned_text[path]
        try:
            ast.parse(text)
        except SyntaxError as exc:
            raise TransformBug(f"the planned {path} does not parse", f"{exc.msg} at line {exc.lineno}") from None
        for patch_id, pairs in judgement.outcomes.items():
            for edit, first in pairs:
                if edit.file != path or first.verdict is not Verdict.PENDING:
                    continue
                again = edit.evaluate(ctx, text)
                if again.verdict is not Verdict.APPLIED or (again.new_text not in (None, text)):
                    raise TransformBug(
                        f"patch {patch_id} is not idempotent on {path}",
                        f"run again on its own output, {edit.label!r} gives {again.verdict.value}, not applied",
                        "report this bug; nothing was written",
                    )


def edit_reports(pairs: list[tuple[Edit, Outcome]]) -> tuple[EditReport, ...]:
    return tuple(EditReport(edit.label, edit.file, o.verdict, o.detail, o.expected, o.found) for edit, o in pairs)


def patch_report(patch: Patch, judgement: Judgement, edits: tuple[EditReport, ...] | None = None) -> PatchReport:
    """One patch's verdict (DESIGN.md, "Verdicts") with the evidence of the edits that decided it."""
    edits = edit_reports(judgement.outcomes[patch.id]) if edits is None else edits
    verdict = combine([e.verdict for e in edits])
    focus = [e for e in edits if e.verdict is verdict]
    detail = "; ".join(dict.fromkeys(e.detail for e in focus)) if focus else "no edits"
    return PatchReport(patch.id, patch.title, verdict, judgement.patch_files(patch.id), detail, edits)
