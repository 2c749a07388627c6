"""Judging: every edit's verdict on a tree, and the files as the pending edits would leave them.

Pure functions over a :class:`patch_dsv4.patch.Context` (and, for a whole
state, over :class:`patch_dsv4.reading.State`): nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from patch_dsv4.errors import TransformBug
from patch_dsv4.fingerprint import find_scope
from patch_dsv4.patch import Context, Edit, Patch
from patch_dsv4.resolve import check_injected, local_names
from patch_dsv4.verdicts import EditReport, Outcome, PatchReport, Verdict, combine

if TYPE_CHECKING:
    from patch_dsv4.reading import State, StateView
    from patch_dsv4.takeover import Restore


@dataclass
class Judgement:
    """Every edit's outcome, the files as read, and the files as the pending edits would write them."""

    outcomes: dict[str, list[tuple[Edit, Outcome]]]  # patch id -> its edits, in order
    originals: dict[str, bytes | None]  # every edited file as read
    planned: dict[str, bytes] = field(default_factory=dict)  # only files that change, encoded as stored
    reads: dict[str, set[str]] = field(default_factory=dict)  # patch id -> every file its judgement read
    unrecorded: dict[str, str] = field(default_factory=dict)  # file read -> why it is not what pip installed

    def patch_files(self, patch_id: str) -> tuple[str, ...]:
        """The files of a patch's edits, leaving out those it has no code path in (where another edit has one)."""
        pairs = self.outcomes[patch_id]
        here = [edit.file for edit, outcome in pairs if outcome.verdict is not Verdict.NOT_APPLICABLE]
        return tuple(dict.fromkeys(here or [edit.file for edit, _ in pairs]))


def _check_names(ctx: Context, edit: Edit, outcome: Outcome, text: str) -> list[str]:
    scope = find_scope(ctx.parse(text), edit.scope.cls, edit.scope.func)
    scope_names = local_names(scope) if scope is not None else set()
    return check_injected(ctx, edit.file, edit.injected_code(outcome), scope_names)


def judge(ctx: Context, patches: list[Patch], check_fit: bool = True, plan: bool = True) -> Judgement:
    """Every edit's verdict on the files as they are, and the files as the pending edits would write them.

    Each edit is judged on the file as it is (edits of one file stand in
    different scopes, or in one scope on disjoint statements with names of
    their own, checked at discovery: one pending edit does not change what
    another sees);
    the pending edits of a file are then written in one libcst pass, and the
    result is proven: it parses, and every edit finds itself applied there.

    A verdict depends only on the code of the edit's own scope and of the
    scopes its probes read: a file that differs from pip's RECORD elsewhere
    changes no verdict (``unrecorded`` names it, for a note; RECORD guards the
    writes, not the judgement). An edit is reported drifted, naming the file,
    only where the file cannot be read as source, is missing though RECORD
    lists it, or differs from RECORD and lacks a scope the judgement looked for
    there (absent evidence in an edited file proves nothing).

    ``check_fit`` checks that the injected code fits the release (every name
    it reads and imports exists there); examples, which hold one file, skip it.
    ``plan=False`` gives the verdicts alone (``planned`` stays empty): for
    reports, which write nothing; what writes plans, and proves its plan.
    """
    outcomes: dict[str, list[tuple[Edit, Outcome]]] = {}
    originals: dict[str, bytes | None] = {}
    texts: dict[str, str | None] = {}
    reads: dict[str, set[str]] = {}
    for patch in patches:
        pairs: list[tuple[Edit, Outcome]] = []
        with ctx.recording() as read:
            for edit in patch.edits:
                if edit.file not in texts:
                    texts[edit.file] = ctx.read(edit.file)
                    originals[edit.file] = ctx.raw(edit.file)
                with ctx.recording() as edit_read, ctx.recording_lookups() as lookups:
                    outcome = edit.evaluate(ctx, texts[edit.file])
                    if outcome.verdict is Verdict.PENDING and check_fit:
                        problems = _check_names(ctx, edit, outcome, texts[edit.file] or "")
                        if problems:
                            outcome = Outcome.drifted(
                                f"{edit.label}: the injected code does not fit this release: " + "; ".join(problems)
                            )
                ctx.read(edit.file)  # the edit's own file counts as read by it, whoever read it first
                pairs.append((edit, _not_judged(ctx, edit, outcome, edit_read | {edit.file}, lookups) or outcome))
        reads[patch.id] = read
        outcomes[patch.id] = _elsewhere(ctx, pairs)
    unrecorded = {
        rel: p.why
        for rel in sorted(set().union(*reads.values()) if reads else ())
        if (p := ctx.problem(rel)) is not None and not p.hard and not p.missing
    }
    judgement = Judgement(outcomes, originals, {}, reads, unrecorded)
    if plan:
        judgement.planned = plan_files(ctx, judgement, set(outcomes))
    return judgement


def plan_files(ctx: Context, judgement: Judgement, patch_ids: set[str]) -> dict[str, bytes]:
    """The files as the pending edits of ``patch_ids`` write them (encoded as stored), proven idempotent.

    Planned from the judgement as it stands: nothing is judged again.
    """
    outcomes = {pid: pairs for pid, pairs in judgement.outcomes.items() if pid in patch_ids}
    texts = {path: ctx.read(path) for path in judgement.originals}
    planned_text = _rewrite(outcomes, texts)
    _prove_idempotent(ctx, outcomes, planned_text)
    return {path: ctx.source(path).encode(text) for path, text in planned_text.items()}


def _elsewhere(ctx: Context, pairs: list[tuple[Edit, Outcome]]) -> list[tuple[Edit, Outcome]]:
    """An edit whose own file is gone (RECORD lists it) has no code path there when another edit of the patch
    found the code it fixes in another file (a class moved between files): not applicable, not drifted."""
    found = [edit.file for edit, o in pairs if o.verdict in (Verdict.PENDING, Verdict.APPLIED, Verdict.FOREIGN)]
    if not found:
        return pairs
    out = []
    for edit, outcome in pairs:
        problem = ctx.problem(edit.file)
        if outcome.verdict is Verdict.DRIFTED and problem is not None and problem.missing:
            outcome = Outcome.not_applicable(f"{problem.why}; the code this edit fixes is in {found[0]}")
        out.append((edit, outcome))
    return out


def _not_judged(ctx: Context, edit: Edit, outcome: Outcome, read: set[str], lookups) -> Outcome | None:
    """Drifted when the judgement rests on a file that cannot vouch for it (see :func:`judge`); else None."""
    for rel in sorted(read, key=lambda r: (r != edit.file, r)):
        problem = ctx.problem(rel)
        if problem is None:
            continue
        why = problem.why
        if not (problem.hard or problem.missing):
            absent = sorted(what for (path, what, found) in lookups if path == rel and not found)
            if not absent:
                continue
            why = f"{problem.why}, and has no {absent[0]}"
        return Outcome.drifted(
            f"{edit.label}: cannot be judged: {why}", expected=f"{rel} as the vLLM release installed it", found=why
        )
    return None


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


def edit_reports(pairs: list[tuple[Edit, Outcome]]) -> tuple[EditReport, ...]:
    return tuple(
        EditReport(edit.label, edit.file, str(edit.scope), o.verdict, o.detail, o.expected, o.found, o.foreign)
        for edit, o in pairs
    )


def patch_report(patch: Patch, judgement: Judgement, edits: tuple[EditReport, ...] | None = None) -> PatchReport:
    """One patch's verdict (DESIGN.md, "Verdicts") with the evidence of the edits that decided it."""
    edits = edit_reports(judgement.outcomes[patch.id]) if edits is None else edits
    verdict = combine([e.verdict for e in edits])
    focus = [e for e in edits if e.verdict is verdict]
    detail = "; ".join(dict.fromkeys(e.detail for e in focus)) if focus else "no edits"
    return PatchReport(patch.id, patch.title, verdict, judgement.patch_files(patch.id), detail, edits)


def as_opt_in(reports: tuple[PatchReport, ...], patches: list[Patch], asked: set[str]) -> tuple[PatchReport, ...]:
    """An opt-in patch nobody asked for is reported as opt-in, whatever its scopes hold: verify and the guard
    ignore it. Another tool's edit there is named, with the command that takes it over."""
    opt = {p.id for p in patches if p.opt_in} - asked
    out = []
    for r in reports:
        if r.id in opt and r.verdict is Verdict.FOREIGN:
            r = replace(
                r,
                verdict=Verdict.OPT_IN,
                detail=f"opt-in: {r.foreign}'s edit stands there; takeover --with {r.id} replaces it ({r.detail})",
            )
        elif r.id in opt and r.verdict in (Verdict.PENDING, Verdict.DRIFTED):
            r = replace(r, verdict=Verdict.OPT_IN, detail=f"opt-in: apply --with {r.id} to use it ({r.detail})")
        out.append(r)
    return tuple(out)


# -- a state judged -------------------------------------------------------------------------
@dataclass
class Judged:
    """A state judged once: the tree the command acts on, and what acting needs to know of it."""

    now: Judgement  # the tree as it is (takeover: with pip's bytes where another tool's edit stood)
    ctx: Context  # what ``now`` read
    reports: tuple[PatchReport, ...]  # per patch, from ``now``; edits we wrote, since changed, are modified
    base: Judgement | None = None  # files we wrote whose edits the patches now write differently, from backups
    base_ctx: Context | None = None
    found: Judgement | None = None  # takeover: the tree as it is, before any restore
    restores: list[Restore] = field(default_factory=list)  # takeover: the files to restore, and their bytes


def judge_state(state: State, takeover: bool = False, with_ids: frozenset[str] = frozenset()) -> Judged:
    """Judge the tree of ``state`` for a report or a plan.

    ``takeover`` judges it twice over: as it is, to find other tools' edits
    (and the backups beside them that hold pip's bytes), then with those
    bytes in place. Files we wrote whose edits drifted are judged again from
    their backups (the release's bytes): where an edit is pending there, it is
    ours as an older patch-dsv4 wrote it, and apply rewrites it.
    """
    from patch_dsv4.takeover import foreign_patches, plan_restores

    patches, view = state.patches, state.view
    found, restores, overlay = None, [], {}
    if takeover:
        found = judge(state.context(), patches, plan=False)
        wanted = state.opt_in_kept | with_ids | foreign_patches(found)
        # files apply would write but must refuse (not pip's bytes), where another tool's backup holds pip's
        refused = {
            edit.file
            for p in patches
            if not p.opt_in or p.id in wanted
            for edit, outcome in found.outcomes[p.id]
            if outcome.verdict is Verdict.PENDING and edit.file not in view.ours
        }
        also = [rel for rel in sorted(refused) if state.differs_from_record(rel)]
        restores = plan_restores(found, state.pip_copy, also=also)
        overlay = {r.relpath: r.data for r in restores if r.data is not None}
    ctx = state.context(overlay)
    now = judge(ctx, patches, plan=False)
    ours_drifted = {
        edit.file
        for pairs in now.outcomes.values()
        for edit, outcome in pairs
        if outcome.verdict is Verdict.DRIFTED and edit.file in view.ours
    }
    base = base_ctx = None
    if ours_drifted:
        base_ctx = state.context(state.release_bytes(sorted(ours_drifted)))
        base = judge(base_ctx, patches, plan=False)
    reports = state_reports(now, patches, view, base if view.kind == "current" else None)
    return Judged(now, ctx, reports, base, base_ctx, found, restores)


def state_reports(
    judgement: Judgement, patches: list[Patch], view: StateView, base: Judgement | None = None
) -> tuple[PatchReport, ...]:
    """Each patch's report; an edit in a file we wrote that changed since is modified, and one whose ``base``
    (the file's release bytes) has it pending is ours as an older patch-dsv4 wrote it: pending."""
    outdated = _outdated_edits(judgement, patches, view, base)
    reports = []
    for patch in patches:
        edits = []
        for (edit, outcome), report in zip(
            judgement.outcomes[patch.id], edit_reports(judgement.outcomes[patch.id]), strict=True
        ):
            if view.kind in ("current", "interrupted") and edit.file in view.modified:
                entry = view.manifest.files[edit.file]
                if patch.id in entry.patches:
                    was = f"{outcome.verdict.value}: {outcome.detail}"
                    detail = f"{edit.file} {view.modified[edit.file]} (was {was})"
                    report = replace(report, verdict=Verdict.MODIFIED, detail=detail)
            elif (patch.id, edit.label) in outdated:
                report = replace(
                    report, verdict=Verdict.PENDING, detail=outdated[(patch.id, edit.label)], expected=None, found=None
                )
            edits.append(report)
        reports.append(patch_report(patch, judgement, tuple(edits)))
    return tuple(reports)


def _outdated_edits(
    judgement: Judgement, patches: list[Patch], view: StateView, base: Judgement | None
) -> dict[tuple[str, str], str]:
    """Our edits in files we wrote that the patches now write differently (a patch-dsv4 upgrade)."""
    if base is None:
        return {}
    found = {}
    for patch in patches:
        for (edit, now), (_, planned) in zip(judgement.outcomes[patch.id], base.outcomes[patch.id], strict=True):
            if edit.file in view.ours and now.verdict is Verdict.DRIFTED and planned.verdict is Verdict.PENDING:
                found[(patch.id, edit.label)] = (
                    f"{edit.label}: {edit.file} holds this edit as an older patch-dsv4 wrote it; apply rewrites it"
                )
    return found
