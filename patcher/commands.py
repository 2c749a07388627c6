"""The command functions: status, verify, apply, revert over one Environment.

Each returns a :class:`patch_dsv4.verdicts.Report` (the CLI only renders it) or
raises a :class:`patch_dsv4.errors.PatcherError` naming what failed, why, and the
command to run next.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from patch_dsv4 import __version__
from patch_dsv4.environment import Environment, record_digest
from patch_dsv4.errors import EXIT_NEEDS_ACTION, EXIT_OK, EnvironmentProblem, Refused
from patch_dsv4.fs import checkpoint, sha256_bytes
from patch_dsv4.judge import Judgement, edit_reports, judge, patch_report
from patch_dsv4.patch import Context, Patch
from patch_dsv4.registry import declared_files, discover_patches, patch_digest
from patch_dsv4.state import FileEntry, Manifest, StateStore
from patch_dsv4.transaction import recover, write_apply, write_revert
from patch_dsv4.verdicts import PatchReport, Report, Verdict


# -- the state as it stands ---------------------------------------------------------
@dataclass
class StateView:
    manifest: Manifest | None
    kind: str  # "none" | "current" | "stale" | "interrupted"
    modified: dict[str, str]  # relpath -> why
    ours: set[str]  # files that are as we wrote them


_NO_STATE = StateView(None, "none", {}, set())


def state_store(env: Environment, patches: list[Patch] | None = None) -> StateStore:
    patches = discover_patches() if patches is None else patches
    return StateStore(env.site_packages, declared_files(patches), [p.id for p in patches])


def read_state(env: Environment, store: StateStore) -> StateView:
    """The manifest and what it says about the files on disk now."""
    manifest = store.load()
    if manifest is None:
        return StateView(None, "none", {}, set())
    if manifest.vllm_version != env.vllm_version:
        return StateView(manifest, "stale", {}, set())
    modified, ours, reinstalled = {}, set(), 0
    for relpath, entry in manifest.files.items():
        now = env.sha256(relpath)
        if now == entry.after:
            ours.add(relpath)
        elif now == entry.before:
            reinstalled += 1
        else:
            modified[relpath] = "changed since patch-dsv4 wrote it"
    if manifest.transaction is not None:
        kind = "interrupted"
    elif manifest.files and reinstalled == len(manifest.files):
        kind = "stale"
    else:
        kind = "current"
    return StateView(manifest, kind, modified, ours)


def context_for(env: Environment, view: StateView = _NO_STATE, overlay: dict[str, bytes] | None = None) -> Context:
    """A Context over the environment's files; ``overlay`` replaces some of them (planned or backed-up bytes).

    A file is taken as installed when pip's RECORD has its hash, or when the
    state says we wrote it (or accepted it with ``--force``).
    """
    accepted: dict[str, set[str]] = {}
    if view.kind == "current" and view.manifest is not None:
        for relpath, entry in view.manifest.files.items():
            accepted.setdefault(relpath, set()).update((entry.after, entry.before))
        for relpath, sha in view.manifest.inputs.items():
            if sha is not None:
                accepted.setdefault(relpath, set()).add(sha)
    overlay = overlay or {}

    def read_bytes(relpath: str) -> bytes | None:
        return overlay[relpath] if relpath in overlay else env.read_bytes(relpath)

    def check_installed(relpath: str, data: bytes | None) -> str | None:
        recorded = env.recorded_hash(relpath)
        if data is None:
            return f"{relpath} is missing, but pip's RECORD lists it" if recorded else None
        if relpath in overlay or recorded == record_digest(data) or sha256_bytes(data) in accepted.get(relpath, ()):
            return None
        if recorded is None:
            return f"{relpath} is not in pip's RECORD"
        return f"{relpath} differs from pip's RECORD (changed by hand, truncated, or from another build)"

    return Context(
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        read_bytes=read_bytes,
        read_flashinfer_bytes=env.read_flashinfer,
        check_installed=check_installed,
    )


# -- reports ---------------------------------------------------------------------------
def _patch_reports(
    env: Environment, judgement: Judgement, patches: list[Patch], view: StateView, store: StateStore | None = None
) -> tuple[PatchReport, ...]:
    outdated = _outdated_edits(env, judgement, patches, view, store)
    reports = []
    for patch in patches:
        edits = []
        for (edit, outcome), report in zip(judgement.outcomes[patch.id], edit_reports(judgement.outcomes[patch.id])):
            if view.kind in ("current", "interrupted") and edit.file in view.modified:
                entry = view.manifest.files[edit.file]
                if patch.id in entry.patches:
                    report = replace(
                        report,
                        verdict=Verdict.MODIFIED,
                        detail=f"{edit.file} {view.modified[edit.file]} (was {outcome.verdict.value}: {outcome.detail})",
                    )
            elif (patch.id, edit.label) in outdated:
                report = replace(report, verdict=Verdict.PENDING, detail=outdated[(patch.id, edit.label)], expected=None, found=None)
            edits.append(report)
        reports.append(patch_report(patch, judgement, tuple(edits)))
    return tuple(reports)


def _outdated_edits(env, judgement, patches, view, store) -> dict[tuple[str, str], str]:
    """Our edits in files we wrote that the patches now write differently (a patch-dsv4 upgrade).

    Such a file is exactly as we wrote it, so the difference is in our edit:
    re-planned from its backup, the edit is pending there, and apply rewrites it.
    """
    if store is None or view.kind != "current":
        return {}
    candidates = {
        edit.file
        for pid, pairs in judgement.outcomes.items()
        for edit, outcome in pairs
        if outcome.verdict is Verdict.DRIFTED and edit.file in view.ours
    }
    if not candidates:
        return {}
    base = _replan(env, store, view, patches, candidates)
    found = {}
    for patch in patches:
        for (edit, now), (_, planned) in zip(judgement.outcomes[patch.id], base.outcomes[patch.id]):
            if edit.file in candidates and now.verdict is Verdict.DRIFTED and planned.verdict is Verdict.PENDING:
                found[(patch.id, edit.label)] = (
                    f"{edit.label}: {edit.file} holds this edit as an older patch-dsv4 wrote it; apply rewrites it"
                )
    return found


def _replan(env, store, view, patches, files) -> Judgement:
    """Judge ``patches`` with ``files`` read from their backups (the release's own bytes)."""
    overlay = {}
    for relpath in files:
        backup = store.read_copy("backups", relpath)
        if backup is None or sha256_bytes(backup) != view.manifest.files[relpath].before:
            raise Refused(
                f"the backup of {relpath} is missing or damaged", "", f"{env.reinstall()}, then patch-dsv4 apply{env.target.args()}"
            )
        overlay[relpath] = backup
    return judge(context_for(env, view, overlay), patches)


def _summary(command: str, reports: tuple[PatchReport, ...], extra: str = "") -> str:
    counts: dict[str, int] = {}
    for r in reports:
        counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
    text = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patches"
    return f"{command}: {text}" + (f"; {extra}" if extra else "")


def _report(env, command, reports, view, exit_code, extra="", changed=(), diff=None, notes=()) -> Report:
    return Report(
        command=command,
        target=str(env.site_packages),
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        patches=reports,
        state=view.kind,
        exit_code=exit_code,
        summary=_summary(command, reports, extra),
        changed_files=tuple(changed),
        diff=diff,
        notes=tuple(notes),
    )


def _state_notes(view: StateView) -> list[str]:
    if view.kind == "stale":
        return [f"state written for vLLM {view.manifest.vllm_version} is stale: its backups will never be restored"]
    if view.kind == "interrupted":
        return ["an earlier apply or revert was interrupted; the next apply or revert finishes it"]
    return []


def select(patches: list[Patch], only: list[str] | None) -> list[Patch]:
    if not only:
        return patches
    known = {p.id for p in patches}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise EnvironmentProblem(
            f"unknown patch id {', '.join(unknown)}", f"known: {', '.join(sorted(known))}", "patch-dsv4 list"
        )
    return [p for p in patches if p.id in only]


# -- status and verify ----------------------------------------------------------------
def status(env: Environment, command: str = "status") -> Report:
    """A verdict per patch for this environment, decided by reading its code; writes nothing."""
    patches = discover_patches()
    store = state_store(env, patches)
    view = read_state(env, store)
    judgement = judge(context_for(env, view), patches)
    reports = _patch_reports(env, judgement, patches, view, store)
    report = _report(env, command, reports, view, EXIT_OK, notes=_state_notes(view))
    return replace(report, build=build_identity(env, view))


def build_identity(env: Environment, view: StateView) -> dict:
    """Whether this vLLM build is a release recorded in anchors/ (files we patched count as they were)."""
    from patch_dsv4.anchors_store import known_release

    def as_installed(relpath: str) -> str | None:
        entry = view.manifest.files.get(relpath) if view.kind == "current" else None
        if entry is not None and relpath in view.ours:
            return entry.before
        return env.sha256(relpath)

    match = known_release(env.vllm_version, as_installed)
    return {"known": match.known, "detail": match.detail}


def fast_verdicts(env: Environment, view: StateView) -> tuple[PatchReport, ...] | None:
    """The verdicts recorded at the last write, when nothing they were based on has changed.

    They stand only if they were made by these patch definitions (their
    digest), with this FlashInfer, from files that all hash as they did, and
    if the build is a release recorded in anchors/ whose needed edits are
    exactly the files the state says we wrote: a state with an empty or forged
    file table never vouches for an unpatched tree. Anything else is judged again.
    """
    from patch_dsv4 import anchors_store

    manifest = view.manifest
    if view.kind != "current" or view.modified or not manifest.verdicts:
        return None
    patches = discover_patches()
    if manifest.patch_digest != patch_digest() or sorted(manifest.verdicts) != sorted(p.id for p in patches):
        return None
    if manifest.flashinfer != {"version": env.flashinfer_version, "source": env.flashinfer_source}:
        return None
    applied_files = {f for v in manifest.verdicts.values() if v["verdict"] == "applied" for f in v["files"]}
    if applied_files != set(manifest.files) or not declared_files(patches) <= set(manifest.inputs):
        return None
    for relpath, sha in manifest.inputs.items():
        if env.sha256(relpath) != sha:
            return None
    record = anchors_store.load(env.vllm_version)
    if record is None or record.get("flashinfer") != manifest.flashinfer:
        return None
    if not build_identity(env, view)["known"]:
        return None
    needed = {
        anchor["file"]
        for pid, entry in record["patches"].items()
        for anchor in entry.get("anchors", [])
        if anchor.get("verdict") == "pending" and pid in manifest.verdicts
    }
    if needed != set(manifest.files):
        return None
    return tuple(
        PatchReport(pid, v["title"], Verdict(v["verdict"]), tuple(v["files"]), v["detail"])
        for pid, v in manifest.verdicts.items()
    )


def verify(env: Environment) -> Report:
    """The CI gate: exit 1 when a patch this environment needs is pending, drifted or modified."""
    store = state_store(env)
    view = read_state(env, store)
    reports = fast_verdicts(env, view)
    if reports is None:
        return _verify_report(env, status(env, command="verify"))
    return _verify_report(env, _report(env, "verify", reports, view, EXIT_OK, "hashes match the recorded state"))


def _verify_report(env: Environment, report: Report) -> Report:
    bad = [r for r in report.patches if r.verdict.needs_action]
    return replace(report, exit_code=EXIT_NEEDS_ACTION if bad else EXIT_OK, next_step=next_step(env, bad))


def next_step(env: Environment, bad: list[PatchReport]) -> str | None:
    """The one command that resolves the patches ``bad`` lists, for the same target."""
    verdicts = {r.verdict for r in bad}
    if not verdicts:
        return None
    if Verdict.MODIFIED in verdicts:
        return f"patch-dsv4 revert --discard-local-edits{env.target.args()}"
    if Verdict.DRIFTED in verdicts:
        return f"patch-dsv4 status{env.target.args()} -v (a patch no longer matches this vLLM: do not serve it)"
    return f"patch-dsv4 apply{env.target.args()}"


def unified_diff(relpath: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{relpath}", f"b/{relpath}")
    )


# -- apply ------------------------------------------------------------------------------
def apply(
    env: Environment,
    only: list[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    lock_timeout: float = 300.0,
) -> Report:
    """Apply every patch this environment needs (or those in ``only``): all files or none."""
    patches = discover_patches()
    store = state_store(env, patches)
    if dry_run:
        return _apply_locked(env, store, patches, only, force, dry_run=True, notes=[])
    with store.lock(lock_timeout):
        notes = recover(env, store)
        return _apply_locked(env, store, patches, only, force, dry_run=False, notes=notes)


def _apply_locked(env, store, patches, only, force, dry_run, notes) -> Report:
    selected = select(patches, only)
    view = read_state(env, store)
    ctx = context_for(env, view)
    judgement = judge(ctx, patches, trust_unrecorded=force)
    reports = _patch_reports(env, judgement, patches, view, store)
    chosen = {p.id for p in selected}
    notes = [*notes, *_state_notes(view)]

    blocked = [r for r in reports if r.id in chosen and r.verdict in (Verdict.DRIFTED, Verdict.MODIFIED)]
    if blocked:
        first = blocked[0]
        unrecorded = [rel for rel in sorted(judgement.reads[first.id]) if (p := ctx.problem(rel)) and not p.hard]
        if unrecorded and first.verdict is Verdict.DRIFTED:
            next_step = f"{env.reinstall()} restores it, or apply --force judges and patches it as it is"
        else:
            next_step = f"patch-dsv4 status{env.target.args()} for details" + (
                "; apply the others with --only" if len(blocked) < len(chosen) else ""
            )
        raise Refused(f"refusing to apply: {first.id} is {first.verdict.value}", first.detail, next_step)
    plan, owners = _plan(env, store, view, patches, selected, judgement, force)
    checkpoint("judged")
    current = {rel: env.read_bytes(rel) for rel in plan}
    planned = {rel: data for rel, data in plan.items() if data != current[rel]}
    if not force:
        for relpath in planned:
            if relpath in view.ours:
                continue
            recorded = env.recorded_hash(relpath)
            if recorded != record_digest(current[relpath] or b""):
                why = "not listed in RECORD" if recorded is None else "its sha256 differs from RECORD"
                raise Refused(
                    f"refusing to patch {relpath}",
                    f"{why} (changed by hand, or another tool patched it)",
                    f"{env.reinstall()}, or apply --force",
                )
    diff = "".join(
        unified_diff(rel, (current[rel] or b"").decode("utf-8", "replace"), data.decode("utf-8", "replace"))
        for rel, data in planned.items()
    )
    if dry_run:
        return _report(
            env, "apply", reports, view, EXIT_OK, f"dry run, {len(planned)} file(s) would change", diff=diff, notes=notes
        )
    if not planned:
        if view.kind == "stale":
            store.remove()
            notes.append("removed the stale state")
        return _report(env, "apply", reports, view, EXIT_OK, "nothing to do", notes=notes)

    previous = view.manifest if view.kind == "current" else None
    if view.kind == "stale":
        store.remove()
    manifest = Manifest(vllm_version=env.vllm_version, tool_version=__version__)
    if previous is not None:
        manifest.files = {rel: FileEntry(e.before, e.after, list(e.patches)) for rel, e in previous.files.items()}
        manifest.opt_in = list(previous.opt_in)
    for relpath, data in planned.items():
        entry = manifest.files.get(relpath)
        if entry is None:
            entry = manifest.files[relpath] = FileEntry(before=sha256_bytes(current[relpath]), after="", patches=[])
        entry.after = sha256_bytes(data)
        entry.patches = sorted(set(entry.patches) | set(owners.get(relpath, ())))
    _record_judgement(env, view, manifest, patches, planned)
    write_apply(env, store, previous, manifest, planned)
    final = read_state(env, store)
    final_reports = _patch_reports(env, judge(context_for(env, final), patches), patches, final, store)
    return _report(
        env, "apply", final_reports, final, EXIT_OK, f"patched {len(planned)} file(s)", changed=planned, notes=notes
    )


def _plan(env, store, view, patches, selected, judgement, force) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """The new bytes of every file the selected patches change, and which patches own each file.

    Files we wrote whose edits the patches now write differently are planned
    again from their backups, with every patch we applied to them.
    """
    replan = {
        edit.file
        for pairs in judgement.outcomes.values()
        for edit, outcome in pairs
        if outcome.verdict is Verdict.DRIFTED and edit.file in view.ours
    }
    wanted = {p.id for p in selected}
    if replan:
        for relpath in replan:
            wanted.update(view.manifest.files[relpath].patches)
        chosen = [p for p in patches if p.id in wanted]
        plan_j = _replan(env, store, view, chosen, replan)
    elif wanted != {p.id for p in patches}:
        plan_j = judge(context_for(env, view), [p for p in patches if p.id in wanted], trust_unrecorded=force)
    else:
        plan_j = judgement
    owners: dict[str, list[str]] = {}
    for patch_id, pairs in plan_j.outcomes.items():
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.PENDING:
                owners.setdefault(edit.file, [])
                if patch_id not in owners[edit.file]:
                    owners[edit.file].append(patch_id)
            elif outcome.verdict is Verdict.DRIFTED and patch_id in wanted:
                raise Refused(f"refusing to apply: {patch_id} is drifted", outcome.detail, f"patch-dsv4 status{env.target.args()}")
    return dict(plan_j.planned), owners


def _record_judgement(env: Environment, view: StateView, manifest: Manifest, patches: list[Patch], planned: dict[str, bytes]) -> None:
    """Judge the planned tree (as it will be on disk) and keep it for verify's fast path."""
    ctx = context_for(env, view, overlay=planned)
    judgement = judge(ctx, patches)
    manifest.verdicts = {
        r.id: {"title": r.title, "verdict": r.verdict.value, "files": list(r.files), "detail": r.detail}
        for r in _patch_reports(env, judgement, patches, _NO_STATE)
    }
    manifest.inputs = {
        rel: (sha256_bytes(planned[rel]) if rel in planned else env.sha256(rel)) for rel in ctx.files_read()
    }
    manifest.flashinfer = {"version": env.flashinfer_version, "source": env.flashinfer_source}
    manifest.patch_digest = patch_digest()


# -- revert -------------------------------------------------------------------------------
def revert(env: Environment, lock_timeout: float = 300.0) -> Report:
    """Restore every file we patched, byte for byte, and remove the state: all or none."""
    patches = discover_patches()
    store = state_store(env, patches)
    with store.lock(lock_timeout):
        notes = recover(env, store)
        view = read_state(env, store)
        notes += _state_notes(view)
        if view.kind == "none":
            reports = _patch_reports(env, judge(context_for(env, view), patches), patches, view)
            return _report(env, "revert", reports, view, EXIT_OK, "nothing to revert", notes=notes)
        if view.kind == "stale":
            store.remove()
            reports = _patch_reports(env, judge(context_for(env), patches), patches, _NO_STATE)
            notes.append("restored nothing from the stale state and removed it")
            return _report(env, "revert", reports, view, EXIT_OK, "nothing to revert", notes=notes)
        if view.modified:
            relpath = sorted(view.modified)[0]
            raise Refused(
                f"refusing to revert: {relpath} {view.modified[relpath]}",
                "restoring it would lose that edit",
                f"{env.reinstall()} restores the release",
            )
        manifest = view.manifest
        restore = {}
        for relpath, entry in manifest.files.items():
            if relpath in view.ours:
                backup = store.read_copy("backups", relpath)
                if backup is None or sha256_bytes(backup) != entry.before:
                    raise Refused(
                        f"refusing to revert {relpath}",
                        "its backup is missing or does not match the recorded hash",
                        env.reinstall(),
                    )
                restore[relpath] = backup
        write_revert(env, store, manifest, restore)
        reports = _patch_reports(env, judge(context_for(env), patches), patches, _NO_STATE)
        return _report(
            env, "revert", reports, _NO_STATE, EXIT_OK, f"restored {len(restore)} file(s)", changed=sorted(restore), notes=notes
        )
