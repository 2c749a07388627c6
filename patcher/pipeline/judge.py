"""Judging: every edit's verdict on a tree, the one step that judges.

:func:`judge` decides the verdicts over a :class:`patch_dsv4.patching.patch.Context`; the command's judgements are made
over its :class:`~patch_dsv4.pipeline.values.Snapshot`: the tree as found (:func:`judge_found`, takeover's first look),
the tree the command acts on (:func:`judge_state`), the tree as a plan leaves it (:func:`judge_planned`) and the tree
as revert leaves it (:func:`judge_reverted`). Nothing here writes; the tree is read through the snapshot only.
"""

from __future__ import annotations

from dataclasses import replace

from patch_dsv4.fastpath.quick import patch_digest
from patch_dsv4.output.errors import Refused
from patch_dsv4.output.verdicts import EditReport, Outcome, PatchReport, Verdict, combine
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.patch import Context, Edit, Patch
from patch_dsv4.patching.resolve import check_injected, local_names
from patch_dsv4.patching.rewrite import plan_files
from patch_dsv4.pipeline.values import (  # noqa: F401 - as_opt_in re-exported
    NO_STATE,
    Judged,
    Judgement,
    Planned,
    Proof,
    Restore,
    Snapshot,
    StateView,
    as_opt_in,
)
from patch_dsv4.tree.environment import record_digest
from patch_dsv4.tree.fs import sha256_bytes


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
        judgement.planned = plan_files(ctx, outcomes, originals, set(outcomes))
    return judgement


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


# -- a state judged -------------------------------------------------------------------------
def judge_found(state: Snapshot) -> Judgement:
    """The tree as it is, before any restore: where other tools' edits stand (takeover's first look)."""
    return judge(state.context(), state.patches, plan=False)


def judge_state(state: Snapshot, restores: list[Restore] = (), found: Judgement | None = None) -> Judged:
    """Judge the tree of ``state`` for a report or a plan, with the ``restores`` (takeover: pip's bytes where
    another tool's edit was ``found``) in place.

    Files we wrote whose edits drifted are judged again from their backups (the
    release's bytes): where an edit is pending there, it is ours as an older
    patch-dsv4 wrote it, and apply rewrites it.
    """
    patches, view = state.patches, state.view
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
        release, refusal = _release_bytes(state, sorted(ours_drifted))
        if refusal is not None:  # judging cannot go on: the command refuses with it
            return Judged(now, ctx, (), found=found, restores=list(restores), refusal=refusal)
        base_ctx = state.context(release)
        base = judge(base_ctx, patches, plan=False)
    changed = _changed_scopes(state) if view.kind in ("current", "interrupted") and view.modified else {}
    reports = state_reports(now, patches, view, base if view.kind == "current" else None, changed)
    return Judged(now, ctx, reports, base, base_ctx, found, list(restores), _way_out(state, now))


def _changed_scopes(state: Snapshot) -> dict[str, dict[str, tuple[str, str | None]]]:
    """For each file we wrote that changed since, the scopes of our edits there whose code changed: scope ->
    (its code as we wrote it, its code now, None where it is gone). A file missing here is one whose bytes as we
    wrote them cannot be had again (no backup, or this patch-dsv4 writes them otherwise): nothing is said of it.

    What we wrote is the backup with the file's patches applied again, taken only where its sha256 is the one the
    manifest recorded: a change is then placed exactly, inside an edit's scope or outside every one.
    """
    view = state.view
    found = {}
    for relpath in view.modified:
        entry = view.manifest.files[relpath]
        patches = [p for p in state.patches if p.id in entry.patches]
        backup = state.backup(relpath)
        if backup is None or not patches:
            continue
        try:
            written = judge(state.context({relpath: backup}), patches).planned.get(relpath)
        except Exception:  # a judgement that cannot be made again says nothing of where the change is
            continue
        now = state.bytes_of(relpath)
        if written is None or now is None or sha256_bytes(written) != entry.after:
            continue
        scopes = {edit.scope for p in patches for edit in p.edits if edit.file == relpath}
        found[relpath] = {
            str(scope): (was, is_)
            for scope in scopes
            if (was := _scope_code(written, scope)) != (is_ := _scope_code(now, scope)) and was is not None
        }
    return found


def _changed_lines(written: str, now: str | None, context: int = 2) -> tuple[str, str | None]:
    """The lines of a scope that changed, as we wrote them and as they are (a few lines around), not the whole."""
    import difflib

    if now is None:
        return written, None
    old, new = written.splitlines(keepends=True), now.splitlines(keepends=True)
    changes = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not changes:
        return written, now
    a0, a1 = max(0, changes[0][1] - context), min(len(old), changes[-1][2] + context)
    b0, b1 = max(0, changes[0][3] - context), min(len(new), changes[-1][4] + context)
    return "".join(old[a0:a1]), "".join(new[b0:b1])


def _scope_code(data: bytes, scope) -> str | None:
    """The source of ``scope`` (class, function) in a file's bytes; None where it is not there or not Python."""
    import ast

    from patch_dsv4.patching.source import SourceError, decode_source

    try:
        text = decode_source(data).text
        node = find_scope(ast.parse(text), scope.cls, scope.func)
    except (SourceError, SyntaxError, ValueError):
        return None
    return None if node is None else ast.get_source_segment(text, node)


def _release_bytes(state: Snapshot, relpaths: list[str]) -> tuple[dict[str, bytes], Refused | None]:
    """The release's bytes of files we wrote, from their backups; the refusal when one is missing or damaged."""
    found = {}
    for relpath in relpaths:
        data = state.backup(relpath)
        if data is None:
            return found, Refused(f"the backup of {relpath} is missing or damaged", "", state.env.reinstall_then())
        found[relpath] = data
    return found, None


def _way_out(state: Snapshot, judgement: Judgement) -> str:
    """The one command that moves a tree with other tools' edits to ours: takeover, or a reinstall where neither a
    backup nor the release's wheel can hold pip's bytes (nothing is fetched to decide it); "" without such edits."""
    from patch_dsv4.releases.release_wheel import unobtainable

    foreign = judgement.foreign_files()
    if not foreign:
        return ""
    env = state.env
    kept = judgement.kept_edits()
    if any(who.startswith(f"{relpath}: ") for relpath in foreign for who in kept):  # takeover would refuse the file
        return f"patch-dsv4 apply{env.target.args()} (the other tool's edits stay where patch-dsv4 never removes one)"
    found = [state.pip_copy(relpath, wheel=False) for relpath in foreign]
    command = f"patch-dsv4 takeover{env.target.args()}"
    if all(f is not None for f in found):
        return f"{command} (saves the edited files, restores pip's from their backups)"
    if unobtainable(env.vllm_version) is None:
        return f"{command} (saves the edited files, restores pip's from backups or the vllm=={env.vllm_version} wheel)"
    return env.reinstall_then()


def judge_planned(state: Snapshot, planned: dict[str, bytes], opt_in: set[str]) -> Planned:
    """The verdicts of the tree as a plan leaves it (``planned`` in place, judged as every judgement is), and the
    sha256 of every file that judgement read: what the manifest records for verify's fast path and the guard."""
    ctx = state.context(planned)
    judgement = judge(ctx, state.patches, plan=False)
    reports = as_opt_in(state_reports(judgement, state.patches, NO_STATE), state.patches, opt_in)
    inputs = {rel: (sha256_bytes(planned[rel]) if rel in planned else state.sha256(rel)) for rel in ctx.files_read()}
    return Planned(reports, inputs, patch_digest())


def judge_reverted(state: Snapshot, to_restore: list[str]) -> tuple[PatchReport, ...]:
    """The verdicts of the tree as revert leaves it: every file in ``to_restore`` back to its backup's bytes."""
    restore = {rel: data for rel in to_restore if (data := state.backup(rel)) is not None}
    ctx = state.reverted_context(restore)
    judgement = judge(ctx, state.patches, plan=False)
    return as_opt_in(state_reports(judgement, state.patches, NO_STATE), state.patches, set())


def state_reports(
    judgement: Judgement,
    patches: list[Patch],
    view: StateView,
    base: Judgement | None = None,
    changed: dict[str, dict[str, tuple[str, str | None]]] | None = None,
) -> tuple[PatchReport, ...]:
    """Each patch's report; an edit in a file we wrote that changed since is modified, and one whose ``base``
    (the file's release bytes) has it pending is ours as an older patch-dsv4 wrote it: pending.

    ``changed`` (:func:`_changed_scopes`) says where such a file changed: in the edit's scope (its code as we
    wrote it is expected, what stands there found) or outside it (the edit itself is intact; the file is not
    what we wrote, which is what verify vouches for)."""
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
                    where = (changed or {}).get(edit.file)
                    if where is not None and str(edit.scope) not in where:
                        detail = (
                            f"{edit.file} changed outside our edit (was {was}); {edit.scope} is as patch-dsv4 wrote"
                            " it, but the file is not, and verify vouches for every byte it wrote"
                        )
                        report = replace(report, verdict=Verdict.MODIFIED, detail=detail, expected=None, found=None)
                    elif where is not None:
                        written, now = _changed_lines(*where[str(edit.scope)])
                        detail = f"{edit.file} changed since patch-dsv4 wrote it (was {was})"
                        report = replace(report, verdict=Verdict.MODIFIED, detail=detail, expected=written, found=now)
                    else:
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


# -- a lost state: what proves the state to rebuild ------------------------------------------------------------------
def judge_rebuild(state: Snapshot, judged: Judged) -> list[Proof]:
    """For each file of ``state`` (a lost state, judged without one as ``judged``) that carries our edits (judged
    applied, by their markers), what would prove a state naming it: pip's bytes, and what those edits write on them.

    pip's bytes are the file's backup in our state where its sha256 is the one RECORD lists (a backup that is
    not is never replaced by other bytes: it may hold what ``apply --force`` patched, which revert must give
    back); where there is none, a backup beside the file or the release's wheel, each checked against RECORD
    (as takeover reads them). The edits that stand applied are then judged and written on those bytes, as apply
    writes them: the file must be exactly that, or nothing proves what it is.
    """
    lost = state.lost
    applied: dict[str, dict[str, None]] = {}  # file -> the patches whose edits stand applied there
    edits = set()
    for patch_id, pairs in judged.now.outcomes.items():
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.APPLIED:
                applied.setdefault(edit.file, {})[patch_id] = None
                edits.add((patch_id, edit.label, edit.file))
    proofs: dict[str, Proof] = {}
    for relpath in sorted(applied):
        now, recorded = state.bytes_of(relpath), state.env.recorded_hash(relpath)
        proof = Proof(relpath, tuple(applied[relpath]), now, None, "")
        if recorded is None:
            proofs[relpath] = replace(proof, source="pip's RECORD does not list it")
        elif relpath in lost.backups:
            backup = lost.backups[relpath]
            if backup is not None and record_digest(backup) == recorded:
                proofs[relpath] = replace(proof, pip=backup, source="backup")
            else:
                why = "is not a regular file" if backup is None else "is not what pip installed (RECORD's sha256)"
                proofs[relpath] = replace(proof, source=f"its backup in {state.store.dir_path.name}/backups/ {why}")
        else:
            found = state.pip_copy(relpath)
            wheel = state.wheel
            if found is not None:
                proofs[relpath] = replace(proof, pip=found[1], source=found[0])
            else:
                why = f": {wheel.problem}" if wheel is not None and wheel.problem else ""
                fetch = wheel is not None and wheel.uncached
                proofs[relpath] = replace(proof, source=f"no backup holds pip's bytes{why}", fetch=fetch)
    proven = {rel: p.pip for rel, p in proofs.items() if p.pip is not None}
    if proven:
        ctx = state.context(proven)
        base = judge(ctx, state.patches, plan=False)
        chosen = {
            pid: [(e, o) for e, o in pairs if (pid, e.label, e.file) in edits and e.file in proven]
            for pid, pairs in base.outcomes.items()
        }
        written = plan_files(ctx, chosen, sorted(proven), set(chosen))
        for relpath, data in proven.items():
            pending = all(
                o.verdict is Verdict.PENDING for pairs in chosen.values() for e, o in pairs if e.file == relpath
            )
            if pending:
                proofs[relpath] = replace(proofs[relpath], written=written.get(relpath, data))
    return list(proofs.values())
