"""The commands: status, verify, apply (and takeover), revert over one Environment, each one pipeline.

    lock -> [a lost state: read -> judge -> prove -> plan the state -> commit it] -> recover
         -> read -> judge -> [takeover: plan the restores -> judge the restored bytes]
         -> plan -> judge the planned bytes -> refuse, or commit -> report

Each step is a function of its own module (:mod:`~patch_dsv4.pipeline.reading`,
:mod:`~patch_dsv4.pipeline.judge`, :mod:`~patch_dsv4.pipeline.takeover`, :mod:`~patch_dsv4.pipeline.planning`,
:mod:`~patch_dsv4.pipeline.transaction`, :mod:`~patch_dsv4.pipeline.reporting`) over the values
the step before gave (:mod:`patch_dsv4.pipeline.values` defines them); only this module calls the steps, and no step
imports another. Each command returns a :class:`patch_dsv4.output.verdicts.Report`
(the CLI only renders it) or raises a :class:`patch_dsv4.output.errors.PatcherError`
naming what failed, why, and the command to run next.
"""

from __future__ import annotations

from dataclasses import replace

from patch_dsv4.fastpath import quick
from patch_dsv4.fastpath.serving import Fingerprint, of_recorded
from patch_dsv4.output.errors import AGAIN, EXIT_NEEDS_ACTION, EXIT_OK, EnvironmentProblem, PatcherError
from patch_dsv4.output.verdicts import Report, next_step
from patch_dsv4.patching.registry import discover_patches
from patch_dsv4.pipeline.judge import judge_found, judge_planned, judge_rebuild, judge_reverted, judge_state
from patch_dsv4.pipeline.planning import (
    lost_note,
    options,
    plan_apply,
    plan_rebuild,
    plan_revert,
    rebuilt_note,
    record_judgement,
    unreadable_state,
)
from patch_dsv4.pipeline.reading import read_lost, read_snapshot, state_store, with_wheel, write_denied
from patch_dsv4.pipeline.reporting import (
    committed_report,
    dry_run_report,
    judged_fingerprint,
    refused_report,
    status_report,
)
from patch_dsv4.pipeline.takeover import plan_restores
from patch_dsv4.pipeline.transaction import commit, commit_rebuild, recover
from patch_dsv4.pipeline.values import LostState, Plan, Rebuild, as_opt_in, to_restore
from patch_dsv4.tree.environment import Environment
from patch_dsv4.tree.fs import checkpoint


def status(env: Environment, command: str = "status", lock_timeout: float = 300.0, on_wait=None, with_=None) -> Report:
    """A verdict per patch for this environment, decided by reading its code; writes nothing.

    A write under way (another process holds the lock) is waited for, up to ``lock_timeout``: a tree half
    written is never judged. ``with_``: opt-ins asked for besides those the state keeps (verify's).
    """
    patches = discover_patches()
    asked = options(patches, with_=with_).with_
    store = state_store(env, patches)
    with store.wait_unlocked(lock_timeout, on_wait):
        lost = read_lost(env, store, absent_too=True)
        snapshot = read_snapshot(env, store, patches, None if lost else True, lost=lost)
        judged = judge_state(snapshot)
        refuse(judged.refusal)
        notes, rebuilt = [], set()
        if lost is not None:  # said as the next apply or revert will do it: the plan they make, nothing fetched
            proofs = judge_rebuild(with_wheel(snapshot, fetch=False), judged)
            rebuild = plan_rebuild(snapshot, proofs, "status")
            if lost.unreadable:  # never a report of a state that cannot be read (verify: never a pass)
                raise unreadable_state(snapshot, rebuild)
            notes = [note for note in (lost_note(snapshot, rebuild),) if note]
            rebuilt = set(rebuild.manifest.files) if rebuild.manifest is not None else set()
        return status_report(snapshot, judged, command, asked, notes, rebuilt)


def verify(env: Environment, lock_timeout: float = 300.0, on_wait=None, with_=None) -> Report:
    """The CI gate: exit 1 when a patch this environment needs is pending, drifted or modified.

    ``with_`` names opt-ins this environment needs besides those its state keeps. The verdicts recorded at the
    last write are reported when the hashes vouch for them (:mod:`patch_dsv4.fastpath.quick`) and they were asked for
    every opt-in in ``with_``; anything else is judged in full.
    """
    site = quick.site_of(env)
    try:
        recorded = quick.vouched(site, options(discover_patches(), with_=with_).with_)
        served = of_recorded(site, recorded) if recorded is not None else None
    except quick.Unreadable:
        recorded = None  # a malformed state or dist-info: judged in full, which refuses it naming it
    if recorded is not None:
        from patch_dsv4.tree.hooks import find_hooks

        hooks = find_hooks(*env.import_path())
        return replace(quick.recorded_report(site, recorded, env.target.args(), hooks, served), fingerprint=served)
    report = status(env, command="verify", lock_timeout=lock_timeout, on_wait=on_wait, with_=with_)
    bad = [r for r in report.patches if r.verdict.needs_action]
    return replace(
        report,
        exit_code=EXIT_NEEDS_ACTION if bad else EXIT_OK,
        next_step=writer_hint(env, report.next_step or next_step(env.target.args(), bad)),
    )


def apply(
    env: Environment,
    only: list[str] | None = None,
    with_: list[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    lock_timeout: float = 300.0,
    on_wait=None,
    takeover: bool = False,
) -> Report:
    """Apply every patch this environment needs (or those in ``only``, with those in ``with_``): all files or none.

    ``with_`` adds opt-in patches, remembered in the state so that later
    applies keep them. ``dry_run`` runs every check apply runs and reports the
    unified diff, writing nothing (it waits for a held lock, as apply would).
    ``takeover`` first replaces every file holding another tool's edit of one of
    the fixes by its sibling backup that is byte for byte what pip installed
    (the edited file is saved first), then applies on those bytes.
    """
    patches = discover_patches()
    opts = options(patches, only, with_, force, takeover, dry_run)
    if not dry_run:
        refuse_unwritable(env, opts.command)
    store = state_store(env, patches)
    with store.wait_unlocked(lock_timeout, on_wait) if dry_run else store.lock(lock_timeout, on_wait):
        lost, notes, manifest = read_lost(env, store), [], True
        if lost is not None:
            rebuilt, notes = rebuild(env, store, patches, lost, opts.command, dry_run)
            manifest = rebuilt.manifest if dry_run else True
        if not dry_run:
            recovered, manifest, refusal = recover(env, store)
            notes += recovered
            refuse(refusal)
        snapshot = read_snapshot(env, store, patches, manifest, vouch=not dry_run)
        if takeover:  # read, judge as found, plan the restores; then judge the restored bytes
            found = judge_found(with_wheel(snapshot))
            judged = judge_state(snapshot, plan_restores(snapshot, found, opts.with_), found)
        else:
            judged = judge_state(snapshot)
        plan = plan_apply(snapshot, judged, opts, notes)
        if plan.refusal is None and plan.to_judge is not None:
            plan = record_judgement(plan, judge_planned(snapshot, plan.to_judge, set(plan.manifest.opt_in)))
        checkpoint("judged")
        refuse(plan.refusal, plan if plan.reported else None)
        if dry_run:
            return dry_run_report(plan)
        report = committed_report(plan, commit(plan))
        if report.fingerprint is None:  # nothing recorded: the tree is as judged
            kept = snapshot.opt_in_kept
            served = judged_fingerprint(snapshot, judged, as_opt_in(judged.reports, patches, kept), kept)
            report = replace(report, fingerprint=served)
        return report


def revert(env: Environment, lock_timeout: float = 300.0, discard_local_edits: bool = False, on_wait=None) -> Report:
    """Restore every file we patched, byte for byte, and remove the state: all or none.

    A patched file changed since we wrote it is refused, unless
    ``discard_local_edits``: then it is first saved under the state directory
    (the report says where), and restored like the others.
    """
    patches = discover_patches()
    refuse_unwritable(env, "revert")
    store = state_store(env, patches)
    with store.lock(lock_timeout, on_wait):
        lost, notes = read_lost(env, store, absent_too=True), []
        if lost is not None:
            notes = rebuild(env, store, patches, lost, "revert")[1]
        recovered, manifest, refusal = recover(env, store)
        notes += recovered
        refuse(refusal)
        snapshot = read_snapshot(env, store, patches, manifest, revert=discard_local_edits)
        reverted = judge_reverted(snapshot, to_restore(snapshot.view))
        plan = plan_revert(snapshot, reverted, discard_local_edits, notes)
        refuse(plan.refusal)
        return committed_report(plan, commit(plan))


def rebuild(
    env: Environment, store, patches, lost: LostState, command: str, dry_run: bool = False
) -> tuple[Rebuild, list[str]]:
    """Rebuild a state without a manifest to go by (call with the lock held, or, for a dry run, none taken and
    nothing written), from proof alone: the tree judged without a state, pip's bytes of each file carrying our edits
    (its backup, else a backup beside it or the release's wheel, fetched where needed), each by RECORD's sha256, and
    those edits written again on them. The plan, and the one line that says what was done; refused (nothing
    written) where anything is not proven."""
    snapshot = with_wheel(read_snapshot(env, store, patches, None, lost=lost))
    judged = judge_state(snapshot)
    refuse(judged.refusal)
    planned = plan_rebuild(snapshot, judge_rebuild(snapshot, judged), command)
    refuse(planned.refusal)
    if dry_run:
        kept_in = ""
    else:
        kept_in = planned.kept_in = commit_rebuild(store, planned) if planned.writes else ""
    note = rebuilt_note(snapshot, planned, kept_in, dry_run)
    return planned, [note] if note else []


def refuse(refusal: PatcherError | None, plan: Plan | None = None) -> None:
    """Raise ``refusal`` (a value of recovery, of judging or of the plan), where there is one: the one place a
    command refuses. A refused apply carries the report of its ``plan``."""
    if refusal is None:
        return
    if plan is not None:
        refusal.report = refused_report(plan)
    raise refusal


def refuse_unwritable(env: Environment, command: str) -> None:
    """A command that writes refuses at once, naming who can run it, where this user may not write the tree."""
    denied = write_denied(env)
    if denied is not None:
        me, owner = denied
        raise EnvironmentProblem(
            f"cannot {command}: {me} may not write {env.site_packages}",
            f"its lock, its state and vLLM's files there belong to {owner}",
            f"{AGAIN}, as {owner}" + ("" if owner == "root" else " or as root"),
        )


def writer_hint(env: Environment, next_command: str | None) -> str | None:
    """A next step that writes the tree, for a user who may not: who must run it."""
    if next_command is None or not next_command.startswith("patch-dsv4 ") or "status" in next_command.split()[:2]:
        return next_command
    denied = write_denied(env)
    if denied is None:
        return next_command
    me, owner = denied
    who = owner if owner == "root" else f"{owner} or as root"
    return f"{next_command}, as {who} ({me} may not write {env.site_packages})"


def fingerprint(env: Environment, lock_timeout: float = 300.0, on_wait=None) -> Fingerprint:
    """The fingerprint of an Environment's tree: from the hashes when they vouch for a judgement (as the guard
    makes it), else from a full judgement (as status makes it)."""
    site = quick.site_of(env)
    try:
        known = quick.known_judgement(site)
        if known is not None:
            return of_recorded(site, known)
    except quick.Unreadable:
        pass  # a malformed state or dist-info: the full judgement refuses it, naming it
    return status(env, lock_timeout=lock_timeout, on_wait=on_wait).fingerprint
