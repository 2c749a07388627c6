"""Planning: what apply or revert will write and record, as one value, from a judged snapshot.

A :class:`~patch_dsv4.pipeline.values.Plan` holds every file to write with its old and new bytes and the
patches that own it, the manifest to record, the per-patch verdicts as they
will stand on disk, the notes, and the refusal when there is one. The plan
functions write nothing, read nothing and judge nothing: they take what the
snapshot holds and what judging gave (the judgement of the planned bytes too,
:func:`record_judgement`); a dry run renders the plan, apply commits it
(:func:`patch_dsv4.pipeline.transaction.commit`), and the report is made from it (:mod:`patch_dsv4.pipeline.reporting`).
"""

from __future__ import annotations

from patch_dsv4 import __version__
from patch_dsv4.output.errors import EnvironmentProblem, Refused
from patch_dsv4.output.render import PACKAGE_PREFIX
from patch_dsv4.output.verdicts import PatchReport, Verdict
from patch_dsv4.patching.patch import Patch
from patch_dsv4.patching.rewrite import plan_files
from patch_dsv4.pipeline.values import (
    Judged,
    Options,
    Plan,
    Planned,
    Proof,
    Rebuild,
    Restore,
    Snapshot,
    as_opt_in,
    state_notes,
    to_restore,
    unrecorded_notes,
)
from patch_dsv4.tree.fs import sha256_bytes
from patch_dsv4.tree.state import SAVED_EDITS, STATE_DIR, FileEntry, Manifest


def options(
    patches: list[Patch], only=None, with_=None, force: bool = False, takeover: bool = False, dry_run: bool = False
) -> Options:
    """The user's options, every patch id checked against the known ones."""
    return Options(
        frozenset(_known_ids(patches, only, "--only")),
        frozenset(_known_ids(patches, with_, "--with")),
        force,
        takeover,
        dry_run,
    )


def _known_ids(patches: list[Patch], ids: list[str] | None, what: str) -> set[str]:
    """``ids`` checked: any patch for ``--only``, an opt-in patch for ``--with`` (the valid choices are named)."""
    known = {p.id for p in patches if p.opt_in or what != "--with"}
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        kind = "opt-in patch" if what == "--with" else "patch"
        raise EnvironmentProblem(
            f"{what} {', '.join(unknown)}: no {kind} {', '.join(unknown)}",
            f"the {kind}es are {', '.join(sorted(known))}",
            "patch-dsv4 list",
        )
    return set(ids or ())


# -- apply ------------------------------------------------------------------------------
def plan_apply(state: Snapshot, judged: Judged, opts: Options, notes: list[str]) -> Plan:
    """The plan of ``apply`` (or ``takeover``) with ``opts`` on the judged ``state``; ``notes`` so far."""
    env, view, patches = state.env, state.view, state.patches
    command = opts.command
    if judged.refusal is not None:
        return Plan(command, state, (), list(notes), refusal=judged.refusal, reported=False)
    notes = list(notes)
    if opts.dry_run and view.kind == "interrupted":
        notes.append("an interrupted apply or revert is pending: apply would finish it first")
    notes += state_notes(view)
    with_ids = set(opts.with_)
    if opts.takeover:
        kept = judged.found.kept_edits()
        mixed = next(((r, who) for r in judged.restores for who in kept if who.startswith(f"{r.relpath}: ")), None)
        if mixed is not None:  # restoring pip's bytes would remove an edit patch-dsv4 has no equivalent for
            return Plan(command, state, (), notes, refusal=_kept_refusal(state, judged, *mixed))
        missing = next((r for r in judged.restores if r.data is None), None)
        if missing is not None:
            return Plan(
                command,
                state,
                (),
                notes,
                refusal=Refused(
                    f"cannot take over {missing.relpath} from {', '.join(missing.scripts)}",
                    "no backup beside it holds what pip installed (its sha256 in RECORD)"
                    + (f", and the release wheel cannot serve: {state.wheel.problem}" if state.wheel else ""),
                    env.reinstall_then(),
                ),
            )
        for r in judged.restores:
            notes.append(f"{r.relpath}: restores pip's bytes from {r.backup} (edited by {', '.join(r.scripts)})")
        if not judged.restores:
            notes.append("no other tool's edit was found: nothing to take over")
        notes += [f"{who}: left in place, patch-dsv4 has no equivalent of it" for who in kept]
        taken = judged.found.foreign_patches() & {p.id for p in patches if p.opt_in}
        if taken - with_ids - state.opt_in_kept:
            notes.append(f"takes over the opt-in {', '.join(sorted(taken))} too, as the other tool's edit was in use")
        with_ids |= taken
    restored = {r.relpath: r.data for r in judged.restores}
    asked = state.opt_in_kept | with_ids
    chosen = {
        p.id for p in patches if (not p.opt_in or p.id in asked) and (not opts.only or p.id in opts.only | with_ids)
    }
    reports = as_opt_in(judged.reports, patches, asked)
    notes += unrecorded_notes(judged.now, view, restored)
    plan = Plan(command, state, reports, notes, restores=list(judged.restores))

    blocked = [
        r for r in reports if r.id in chosen and r.verdict in (Verdict.DRIFTED, Verdict.MODIFIED, Verdict.FOREIGN)
    ]
    if blocked:
        plan.refusal = _refusal(state, judged, blocked, chosen)
        return plan
    planned, owners, drifted = _planned_files(state, judged, chosen)
    if drifted is not None:
        plan.refusal = drifted
        return plan
    for relpath, data in restored.items():
        planned.setdefault(relpath, data)
    current = {rel: state.held(rel) for rel in planned}
    plan.new = {rel: data for rel, data in planned.items() if data != current[rel]}
    plan.old = {rel: current[rel] for rel in plan.new}
    plan.owners = {rel: owners.get(rel, []) for rel in plan.new}
    plan.refusal = _unreplaceable(state, plan.new, "patch")
    if plan.refusal is not None:  # --force consents to writing a file, never to writing into another tool's mount
        return plan
    if not opts.force:
        plan.refusal = _unrecorded_write(state, plan, restored)
        if plan.refusal is not None:
            return plan

    new_opt_in = sorted(with_ids - state.opt_in_kept)
    if not plan.new and not (new_opt_in and view.kind == "current"):
        # nothing to write; a dry run records nothing either
        plan.summary = "nothing to do"
        if opts.dry_run:
            return plan
        if view.kind == "stale":
            plan.remove_state = True
            notes.append("removed the stale state")
        elif view.kind == "current" and not view.modified and not state.recorded_holds:
            # recorded again (another patch-dsv4, or another FlashInfer, made the last) unless it is what is
            # recorded already: record_judgement decides, from the judgement of the tree as it is
            previous = view.manifest
            plan.manifest = Manifest(
                env.vllm_version, __version__, _copied_files(previous), opt_in=list(previous.opt_in)
            )
            plan.to_judge = {}
        return plan

    plan.save = [r.relpath for r in judged.restores]
    plan.originals = restored
    plan.previous = view.manifest if view.kind == "current" else None
    plan.remove_state = view.kind == "stale"
    manifest = Manifest(vllm_version=env.vllm_version, tool_version=__version__)
    if plan.previous is not None:
        manifest.files = _copied_files(plan.previous)
    manifest.opt_in = sorted(asked & {p.id for p in patches if p.opt_in})
    for relpath, data in plan.new.items():
        entry = manifest.files.get(relpath)
        if entry is None:
            before = restored.get(relpath, current[relpath])
            entry = manifest.files[relpath] = FileEntry(before=sha256_bytes(before), after="", patches=[])
        entry.after = sha256_bytes(data)
        entry.patches = sorted(set(entry.patches) | set(plan.owners[relpath]))
    plan.manifest = manifest
    plan.to_judge = plan.new
    ours_after = set(plan.new) | (view.ours & set(manifest.files))
    plan.installed_after = {rel: manifest.files[rel].before for rel in ours_after}
    taken = f"took over {len(judged.restores)} file(s), " if opts.takeover else ""
    plan.summary = f"{taken}patched {len(plan.new)} file(s)"
    return plan


def _planned_files(
    state: Snapshot, judged: Judged, chosen: set[str]
) -> tuple[dict[str, bytes], dict[str, list[str]], Refused | None]:
    """The new bytes of every file the chosen patches change, which patches own each file, and the refusal when
    a chosen patch is drifted where it is planned.

    Planned from the judgement; files we wrote whose edits the patches now
    write differently are planned from their backups (the release's bytes),
    with every patch we applied to them.
    """
    env, view = state.env, state.view
    wanted = set(chosen)
    if judged.base is not None:
        for pairs in judged.now.outcomes.values():
            for edit, outcome in pairs:
                if outcome.verdict is Verdict.DRIFTED and edit.file in view.ours:
                    wanted.update(view.manifest.files[edit.file].patches)
        source, ctx = judged.base, judged.base_ctx
    else:
        source, ctx = judged.now, judged.ctx
    planned = plan_files(ctx, source.outcomes, source.originals, wanted)
    owners: dict[str, list[str]] = {}
    for patch in state.patches:
        if patch.id not in wanted:
            continue
        for edit, outcome in source.outcomes[patch.id]:
            if outcome.verdict is Verdict.PENDING:
                owners.setdefault(edit.file, [])
                if patch.id not in owners[edit.file]:
                    owners[edit.file].append(patch.id)
            elif outcome.verdict is Verdict.DRIFTED:
                why = Refused(
                    f"refusing to apply: {patch.id} is drifted", outcome.detail, f"patch-dsv4 status{env.target.args()}"
                )
                return planned, owners, why
    return planned, owners, None


def _unreplaceable(state: Snapshot, relpaths, verb: str) -> Refused | None:
    """The refusal to write a file that lies on another tool's mount (the file, or a directory above it: the
    snapshot read which, patch_dsv4.tree.mounts), or where the state directory does, before anything is written;
    None when no file of the plan is."""
    blocked = [rel for rel in sorted(relpaths) if rel in state.mounted]
    if relpaths and STATE_DIR in state.mounted:  # the backups and the manifest would go into another tool's mount
        blocked.insert(0, STATE_DIR)
    if not blocked:
        return None
    more = f" (and {len(blocked) - 1} more file(s): patch-dsv4 status names them)" if len(blocked) > 1 else ""
    return Refused(f"cannot {verb} {blocked[0]}{more}", state.mounted[blocked[0]], "")


def _unrecorded_write(state: Snapshot, plan: Plan, restored: dict[str, bytes]) -> Refused | None:
    """Without --force, a file apply would write must be what pip installed (or what we wrote)."""
    from patch_dsv4.tree.environment import record_digest

    env = state.env
    for relpath in plan.new:
        if relpath in state.view.ours or relpath in restored:
            continue
        recorded = env.recorded_hash(relpath)
        if recorded != record_digest(plan.old[relpath] or b""):
            why = "not listed in RECORD" if recorded is None else "its sha256 differs from RECORD"
            return Refused(
                f"refusing to patch {relpath}",
                f"{why} (changed by hand, or another tool patched it)",
                f"{env.reinstall()}; or apply --force to patch it as it is",
            )
    return None


def _refusal(state: Snapshot, judged: Judged, blocked: list[PatchReport], chosen: set[str]) -> Refused:
    """Why apply will not write, in a few words, and the one command that gets past it."""
    env = state.env
    first = blocked[0]
    if first.verdict is Verdict.MODIFIED:
        edited = sorted(f for f in first.files if f in {e.file for e in first.edits if e.verdict is Verdict.MODIFIED})
        return Refused(
            f"refusing to apply: {first.id} is modified",
            f"{edited[0] if edited else 'a file'} changed since patch-dsv4 wrote it",
            f"patch-dsv4 revert --discard-local-edits{env.target.args()} (saves your edit first), then apply",
        )
    if first.verdict is Verdict.FOREIGN:
        edit = next(e for e in first.edits if e.verdict is Verdict.FOREIGN)
        return Refused(
            f"refusing to apply: {first.id} holds another tool's edit ({first.foreign})",
            f"in {edit.file.replace(PACKAGE_PREFIX, '')}; patch-dsv4 never writes its edit behind another",
            judged.way_out,
        )
    edit = next((e for e in first.edits if e.verdict is first.verdict), None)
    why = edit.detail if edit is not None else first.detail
    others = "; apply the others with --only" if len(blocked) < len(chosen) else ""
    if edit is not None and "cannot be judged" in edit.detail:
        return Refused(
            f"refusing to apply: {first.id} cannot be judged",
            why.replace(PACKAGE_PREFIX, ""),
            env.reinstall_then(),
        )
    return Refused(
        f"refusing to apply: {first.id} is drifted",
        why.replace(PACKAGE_PREFIX, ""),
        f"patch-dsv4 status -v{env.target.args()}{others}",
    )


def _kept_refusal(state: Snapshot, judged: Judged, restore: Restore, who: str) -> Refused:
    """A file to take over also holds another tool's edit patch-dsv4 never removes: the take-over stops there."""
    taken = sorted(
        pid
        for pid, pairs in judged.found.outcomes.items()
        if any(e.file == restore.relpath and o.verdict is Verdict.FOREIGN for e, o in pairs)
    )
    return Refused(
        f"cannot take over {restore.relpath} from {', '.join(restore.scripts)}",
        f"it also holds {who.split(': ', 1)[1]}'s edit, which patch-dsv4 has no equivalent for and never removes",
        f"patch-dsv4 apply{state.env.target.args()} (without --with {' --with '.join(taken)}: that edit stays "
        "the other tool's)",
    )


def _copied_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The file table of ``manifest``, copied (a new manifest starts from it and may change its entries)."""
    return {rel: FileEntry(e.before, e.after, list(e.patches)) for rel, e in manifest.files.items()}


def record_judgement(plan: Plan, planned: Planned) -> Plan:
    """``plan`` with the judgement of the tree as it leaves it (``planned``,
    :func:`patch_dsv4.pipeline.judge.judge_planned` over ``plan.to_judge``) kept in its manifest, for verify's fast path
    and the guard.

    A manifest recorded again on a tree left as it is is dropped when it is what is recorded already (an apply
    with nothing to do writes nothing twice).
    """
    state, manifest = plan.state, plan.manifest
    manifest.verdicts = {
        r.id: {
            "title": r.title,
            "verdict": r.verdict.value,
            "files": list(r.files),
            "detail": r.detail,
            "edits": [e.to_json() for e in r.edits],
        }
        for r in planned.reports
    }
    manifest.inputs = planned.inputs
    manifest.flashinfer = {"version": state.env.flashinfer_version, "source": state.env.flashinfer_source}
    manifest.patch_digest = planned.patch_digest
    if plan.writes:
        plan.after = planned.reports
    elif manifest.to_json() == state.view.manifest.to_json():
        plan.manifest = None
    else:
        plan.notes.append("recorded this build's verdicts for verify and the serve guard")
    return plan


# -- revert -----------------------------------------------------------------------------
def plan_revert(
    state: Snapshot, reverted: tuple[PatchReport, ...], discard_local_edits: bool, notes: list[str]
) -> Plan:
    """The plan of ``revert``: every file we wrote back to its backup, the state removed; ``reverted`` are the
    verdicts of the tree it leaves."""
    env, view = state.env, state.view
    notes = [*notes, *state_notes(view)]
    plan = Plan("revert", state, reverted, notes, after=reverted)
    if view.kind in ("none", "stale"):
        plan.summary = "nothing to revert"
        plan.remove_state = view.kind == "stale"
        if plan.remove_state:
            notes.append("restored nothing from the stale state and removed it")
        return plan
    if view.modified and not discard_local_edits:
        relpath = sorted(view.modified)[0]
        plan.refusal = Refused(
            f"refusing to revert: {relpath} {view.modified[relpath]}",
            "restoring it would lose that edit",
            f"patch-dsv4 revert --discard-local-edits{env.target.args()} (saves your edit first)",
        )
        return plan
    for relpath in to_restore(view):
        backup = state.held_backup(relpath)
        if backup is None:
            plan.refusal = Refused(
                f"refusing to revert {relpath}",
                "its backup is missing or does not match the recorded hash",
                env.reinstall(),
            )
            return plan
        plan.new[relpath] = backup
        plan.old[relpath] = state.held(relpath)
        plan.owners[relpath] = list(view.manifest.files[relpath].patches)
    # every file the state names, not only those written back: one that a mount shows with pip's bytes may hide
    # our edit below it, and removing the state would forget the backup that undoes it
    plan.refusal = _unreplaceable(state, sorted({*plan.new, *view.manifest.files}), "revert")
    if plan.refusal is not None:
        return plan
    plan.previous = view.manifest
    plan.save = sorted(view.modified)
    plan.summary = f"restored {len(plan.new)} file(s)"
    plan.installed_after = {rel: view.manifest.files[rel].before for rel in plan.new}
    return plan


# -- a lost state, rebuilt ----------------------------------------------------------------------
def plan_rebuild(state: Snapshot, proofs: list[Proof], command: str = "apply") -> Rebuild:
    """The state to write where ``state`` has no manifest to go by (``state.lost``), from proof alone, or the
    refusal: one entry per file that carries our edits, where its backup (or a backup beside it, or the release's
    wheel) holds pip's bytes by RECORD's sha256 and the file is exactly what those edits write on them.

    Nothing the lost state says is believed: its manifest is never read for it, and a backup is used only as pip's
    bytes proven by RECORD. Every other backup is removed where it holds the file's bytes as they are (nothing is
    lost), and set aside under saved-edits/ otherwise (with an unreadable manifest): never deleted, never restored.
    ``command``: the one being run (apply or revert; status and verify name apply), as a refusal's next step says.
    """
    env, lost = state.env, state.lost
    rebuild = Rebuild(lost)
    for proof in proofs:
        if proof.fetch:
            rebuild.fetch = True  # status: the wheel decides, once apply or revert has fetched it
        elif proof.pip is None or proof.written != proof.now:
            rebuild.unproven = _unproven(proof)
            rebuild.refusal = _cannot_rebuild(state, rebuild.unproven, command)
            return rebuild
    if rebuild.fetch:
        return rebuild
    if proofs:
        opt_in = {p.id for p in state.patches if p.opt_in}
        manifest = Manifest(env.vllm_version, __version__)
        for proof in proofs:
            manifest.files[proof.relpath] = FileEntry(
                sha256_bytes(proof.pip), sha256_bytes(proof.now), sorted(proof.patches)
            )
        manifest.opt_in = sorted({pid for proof in proofs for pid in proof.patches} & opt_in)
        rebuild.manifest = manifest
        rebuild.backups = {p.relpath: p.pip for p in proofs if p.source != "backup"}
        rebuild.sources = {p.relpath: p.source for p in proofs}
    keep, drop = list(lost.others), []
    for relpath, data in lost.backups.items():
        if rebuild.sources.get(relpath) == "backup":
            continue
        (drop if data is not None and data == state.held(relpath) else keep).append(relpath)
    rebuild.keep, rebuild.drop = tuple(sorted(keep)), tuple(drop)
    if rebuild.writes and STATE_DIR in state.mounted:
        rebuild.refusal = Refused(f"cannot rebuild {STATE_DIR}", state.mounted[STATE_DIR], "")
    return rebuild


def _unproven(proof: Proof) -> str:
    """What leaves ``proof``'s file without proof, in words."""
    if proof.pip is None:
        why = proof.source
    else:
        why = "it is neither pip's bytes nor what the patches write on them (another edit stands beside ours)"
    return f"{proof.relpath} carries patch-dsv4's edits, but {why}"


def _cannot_rebuild(state: Snapshot, unproven: str, command: str) -> EnvironmentProblem:
    """The refusal to rebuild, with the way out: pip's own files again (the backups the rebuild cannot use are
    then set aside, never lost)."""
    lost = state.lost
    if not lost.present:
        had = "there is none"
    else:
        had = "its manifest cannot be read" if lost.unreadable else "it has no manifest"
    return EnvironmentProblem(
        f"cannot rebuild the state {state.store.dir_path}",
        f"{had}, and {unproven}",
        state.env.reinstall_then(command if command != "status" else "apply"),
    )


def _sources(state: Snapshot, rebuild: Rebuild) -> str:
    """Where a rebuild takes pip's bytes from, in a few words."""
    sources = rebuild.sources.values()
    ours = sum(1 for source in sources if source == "backup")
    backups = f"{STATE_DIR}/backups/"
    parts = (
        [f"their backups in {backups}" if ours == len(sources) else f"{ours} backup(s) in {backups}"] if ours else []
    )
    for source in sources:
        if source.startswith("the release wheel"):
            parts.append(f"the vllm=={state.env.vllm_version} wheel")
        elif source != "backup":
            parts.append(f"{source} beside its file")
    return ", ".join(dict.fromkeys(parts))


def _kept(rebuild: Rebuild, where: str, later: bool = False) -> str:
    """What a rebuild sets aside, and where (``later``: said before it is done, by status or a dry run)."""
    what = ["the unreadable manifest"] if rebuild.lost.unreadable else []
    if rebuild.keep:
        what.append(f"{len(rebuild.keep)} backup(s) that are not their file's bytes")
    kept = "to be kept" if later else "kept"
    return f"; {' and '.join(what)} {kept} in {where}" if what else ""


def _proven(state: Snapshot, rebuild: Rebuild) -> str:
    return (
        f"pip's bytes from {_sources(state, rebuild)}, proven by RECORD's sha256, and each file what the patches "
        "write on them"
    )


def rebuilt_note(state: Snapshot, rebuild: Rebuild, kept_in: str = "", dry_run: bool = False) -> str:
    """What apply or revert says it did to a lost state ("" where it did nothing): the one line that names the
    rebuild and what proved it."""
    lost, where = rebuild.lost, kept_in or f"{STATE_DIR}/{SAVED_EDITS}/"
    rebuilt, removed = ("would rebuild", "would remove") if dry_run else ("rebuilt", "removed")
    if rebuild.manifest is not None:
        files = len(rebuild.manifest.files)
        return (
            f"{rebuilt} the state ({files} file(s), vLLM {state.env.vllm_version}): {_proven(state, rebuild)}"
            f"{_kept(rebuild, where, dry_run)}"
        )
    if not lost.present:
        return ""
    return (
        f"{removed} {STATE_DIR}/ without a manifest: no file carries patch-dsv4's edits{_kept(rebuild, where, dry_run)}"
    )


def lost_note(state: Snapshot, rebuild: Rebuild) -> str:
    """What status says of a lost state: what the next apply or revert does to it ("" where there is nothing to
    do), from the very plan those make."""
    lost, env = rebuild.lost, state.env
    if lost.present:
        lead = "the state has no manifest: the next apply or revert"
    else:
        lead = "no state names the files that carry patch-dsv4's edits (apply leaves it so): the next revert"
    if rebuild.refusal is not None:
        refusal = rebuild.refusal
        return f"{lead} refuses to rebuild it: {rebuild.unproven or refusal.why} (next: {refusal.next_step})"
    if rebuild.fetch:
        return (
            f"{lead} rebuilds it once it has fetched the vllm=={env.vllm_version} wheel with pip for pip's bytes "
            "(where pip cannot fetch it, it refuses: reinstall vLLM)"
        )
    if rebuild.manifest is not None:
        return f"{lead} rebuilds it: {_proven(state, rebuild)}{_kept(rebuild, f'{STATE_DIR}/{SAVED_EDITS}/', True)}"
    if not lost.present:
        return ""
    return (
        f"an apply was interrupted before it changed a file: {STATE_DIR}/ holds what it prepared, which the next "
        "apply or revert removes (nothing else to do: the files are as this report says)"
        f"{_kept(rebuild, f'{STATE_DIR}/{SAVED_EDITS}/', True)}"
    )


def unreadable_state(state: Snapshot, rebuild: Rebuild) -> EnvironmentProblem:
    """The refusal of status and verify (never a pass) where the manifest cannot be read: it names the state, why,
    and the repair: apply, which rebuilds it (or, where it cannot, what can)."""
    env, lost = state.env, rebuild.lost
    why, repair = lost.unreadable, f"patch-dsv4 apply{env.target.args()}"
    if rebuild.refusal is not None:
        why += f"; apply cannot rebuild it: {rebuild.unproven or rebuild.refusal.why}"
        repair = rebuild.refusal.next_step or repair
    elif rebuild.fetch:
        wheel = f"the vllm=={env.vllm_version} wheel"
        repair += f" (rebuilds it with pip's bytes from {wheel}, which it fetches; it refuses where pip cannot)"
    elif rebuild.manifest is not None:
        repair += f" (rebuilds it with pip's bytes from {_sources(state, rebuild)})"
    else:
        repair += " (sets it aside: no file carries patch-dsv4's edits)"
    return EnvironmentProblem(f"unreadable state {state.store.dir_path}", why, repair)
