"""The command functions: status, verify, apply, revert over one Environment.

Each returns a :class:`patch_dsv4.verdicts.Report` (the CLI only renders it) or
raises a :class:`patch_dsv4.errors.PatcherError` naming what failed, why, and the
command to run next.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from patch_dsv4 import __version__, quick
from patch_dsv4.environment import Environment, record_digest
from patch_dsv4.errors import EXIT_NEEDS_ACTION, EXIT_OK, EnvironmentProblem, Refused
from patch_dsv4.fs import UnsafePath, checkpoint, sha256_bytes
from patch_dsv4.judge import Judgement, as_opt_in, edit_reports, judge, patch_report, plan_files
from patch_dsv4.patch import Context, Patch
from patch_dsv4.quick import patch_digest
from patch_dsv4.registry import declared_files, discover_patches
from patch_dsv4.state import STATE_DIR, FileEntry, Manifest, StateStore
from patch_dsv4.transaction import recover, write_apply, write_revert
from patch_dsv4.render import PACKAGE_PREFIX
from patch_dsv4.verdicts import PatchReport, Report, Verdict, next_step, summary_line


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


def _report(env, command, reports, view, exit_code, extra="", changed=(), diff=None, notes=(), store=None) -> Report:
    backups = str(store.dir_path / "backups") if store is not None and store.manifest_exists() else None
    return Report(
        command=command,
        target=str(env.site_packages),
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        patches=reports,
        state=view.kind,
        exit_code=exit_code,
        summary=summary_line(command, reports, extra),
        changed_files=tuple(changed),
        diff=diff,
        notes=tuple(notes),
        backups=backups,
    )


def _state_notes(view: StateView) -> list[str]:
    if view.kind == "stale":
        return [f"state written for vLLM {view.manifest.vllm_version} is stale: its backups will never be restored"]
    if view.kind == "interrupted":
        return ["an earlier apply or revert was interrupted; the next apply or revert finishes it"]
    return []


def _known_ids(patches: list[Patch], ids: list[str] | None, what: str) -> set[str]:
    known = {p.id for p in patches}
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        raise EnvironmentProblem(
            f"unknown patch id {', '.join(unknown)} ({what})", f"known: {', '.join(sorted(known))}", "patch-dsv4 list"
        )
    return set(ids or ())


def _opt_in_kept(view: StateView) -> set[str]:
    return set(view.manifest.opt_in) if view.kind in ("current", "interrupted") and view.manifest else set()


# -- status and verify ----------------------------------------------------------------
def status(env: Environment, command: str = "status", lock_timeout: float = 300.0, on_wait=None) -> Report:
    """A verdict per patch for this environment, decided by reading its code; writes nothing.

    A write under way (another process holds the lock) is waited for, up to ``lock_timeout``: a tree half
    written is never judged.
    """
    patches = discover_patches()
    store = state_store(env, patches)
    with store.wait_unlocked(lock_timeout, on_wait):
        return _status(env, store, patches, command)


def _status(env: Environment, store: StateStore, patches: list[Patch], command: str) -> Report:
    view = read_state(env, store)
    judgement = judge(context_for(env, view), patches, plan=False)
    reports = as_opt_in(_patch_reports(env, judgement, patches, view, store), patches, _opt_in_kept(view))
    notes = [*_state_notes(view), *_unrecorded_notes(judgement, view)]
    report = _report(env, command, reports, view, EXIT_OK, notes=notes, store=store)
    bad = [r for r in reports if r.verdict.needs_action]
    if any(r.verdict is Verdict.FOREIGN for r in bad):  # the way out is not apply: say which it is
        report = replace(report, next_step=next_step(env.target.args(), bad, takeover_next(env, judgement)))
    return replace(report, build=build_identity(env, view))


def build_identity(env: Environment, view: StateView) -> dict:
    """Whether this vLLM build is a release recorded in anchors/ (files we patched count as they were)."""
    from patch_dsv4.anchors_store import known_release, listed_package_files

    def as_installed(relpath: str) -> str | None:
        entry = view.manifest.files.get(relpath) if view.kind == "current" else None
        if entry is not None and relpath in view.ours:
            return entry.before
        return env.sha256(relpath)

    match = known_release(env.vllm_version, as_installed, files=listed_package_files(env.site_packages))
    return {"known": match.known, "detail": match.detail}


def verify(env: Environment, lock_timeout: float = 300.0, on_wait=None) -> Report:
    """The CI gate: exit 1 when a patch this environment needs is pending, drifted or modified.

    The verdicts recorded at the last write are reported when the hashes vouch
    for them (:mod:`patch_dsv4.quick`); anything else is judged in full.
    """
    store = state_store(env)
    view = read_state(env, store)
    if view.kind == "current" and not view.modified:
        site = quick.site_of(env)
        recorded = quick.recorded_verdicts(site)
        if recorded is not None:
            return quick.recorded_report(site, recorded, env.target.args())
    report = status(env, command="verify", lock_timeout=lock_timeout, on_wait=on_wait)
    bad = [r for r in report.patches if r.verdict.needs_action]
    return replace(
        report,
        exit_code=EXIT_NEEDS_ACTION if bad else EXIT_OK,
        next_step=report.next_step or next_step(env.target.args(), bad),
    )


def unified_diff(relpath: str, old: bytes, new: bytes) -> bytes:
    """The change of one file as a unified diff that ``patch -p1`` applies inside the site directory, byte for byte.

    Diffed as bytes (any encoding, CRLF kept); a last line without a newline is marked as diff marks it.
    """
    lines = difflib.diff_bytes(
        difflib.unified_diff,
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        f"a/{relpath}".encode(),
        f"b/{relpath}".encode(),
    )
    out = []
    for line in lines:
        if line.startswith((b"---", b"+++")) and not line.endswith(b"\n"):
            line += b"\n"
        out.append(line)
        if not line.endswith(b"\n"):
            out.append(b"\n\\ No newline at end of file\n")
    return b"".join(out)


# -- apply ------------------------------------------------------------------------------
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
    store = state_store(env, patches)
    if dry_run:
        with store.wait_unlocked(lock_timeout, on_wait):
            return _apply_locked(env, store, patches, only, with_, force, True, [], takeover)
    with store.lock(lock_timeout, on_wait):
        notes = recover(env, store)
        return _apply_locked(env, store, patches, only, with_, force, False, notes, takeover)


def takeover_next(env: Environment, judgement: Judgement) -> str:
    """The one command that moves a tree with other tools' edits to ours: takeover, or a reinstall where no
    backup holds pip's bytes."""
    from patch_dsv4.takeover import plan_restores

    restores = plan_restores(env, judgement)
    if restores and all(r.data is not None for r in restores):
        return f"patch-dsv4 takeover{env.target.args()} (saves the edited files, restores pip's from their backups)"
    return f"{env.reinstall()}, then patch-dsv4 apply{env.target.args()}"


def _apply_locked(env, store, patches, only, with_, force, dry_run, notes, takeover=False) -> Report:
    from patch_dsv4.takeover import foreign_patches, plan_restores

    command = "takeover" if takeover else "apply"
    only_ids = _known_ids(patches, only, "--only")
    with_ids = _known_ids(patches, with_, "--with")
    view = read_state(env, store)
    if dry_run and view.kind == "interrupted":
        notes.append("an interrupted apply or revert is pending: apply would finish it first")
    notes = [*notes, *_state_notes(view)]
    restored: dict[str, bytes] = {}
    restores = []
    if takeover:
        found = judge(context_for(env, view), patches, plan=False)
        wanted = _opt_in_kept(view) | with_ids | foreign_patches(found)
        # files apply would write but must refuse (not pip's bytes), where another tool's backup holds pip's
        refused = {
            edit.file
            for p in patches
            if not p.opt_in or p.id in wanted
            for edit, outcome in found.outcomes[p.id]
            if outcome.verdict is Verdict.PENDING and edit.file not in view.ours
        }
        restores = plan_restores(env, found, also=[rel for rel in sorted(refused) if _differs_from_record(env, rel)])
        for r in restores:
            if r.data is None:
                raise Refused(
                    f"cannot take over {r.relpath} from {', '.join(r.scripts)}",
                    "no backup beside it holds what pip installed (its sha256 in RECORD)",
                    f"{env.reinstall()}, then patch-dsv4 apply{env.target.args()}",
                )
            notes.append(f"{r.relpath}: restores pip's bytes from {r.backup} (edited by {', '.join(r.scripts)})")
        if not restores:
            notes.append("no other tool's edit was found: nothing to take over")
        taken = foreign_patches(found) & {p.id for p in patches if p.opt_in}
        if taken - with_ids - _opt_in_kept(view):
            notes.append(f"takes over the opt-in {', '.join(sorted(taken))} too, as the other tool's edit was in use")
        with_ids |= taken
        restored = {r.relpath: r.data for r in restores}
    asked = _opt_in_kept(view) | with_ids
    chosen = {p.id for p in patches if (not p.opt_in or p.id in asked) and (not only_ids or p.id in only_ids | with_ids)}
    ctx = context_for(env, view, overlay=restored)
    judgement = judge(ctx, patches, plan=False)
    reports = as_opt_in(_patch_reports(env, judgement, patches, view, store), patches, asked)
    notes += _unrecorded_notes(judgement, view, restored)

    blocked = [r for r in reports if r.id in chosen and r.verdict in (Verdict.DRIFTED, Verdict.MODIFIED, Verdict.FOREIGN)]
    if blocked:
        raise _refusal(env, judgement, blocked, chosen, force)
    plan, owners = _plan(env, store, view, patches, chosen, judgement, ctx)
    for relpath, data in restored.items():
        plan.setdefault(relpath, data)
    checkpoint("judged")
    current = {rel: env.read_bytes(rel) for rel in plan}
    planned = {rel: data for rel, data in plan.items() if data != current[rel]}
    if not force:
        for relpath in planned:
            if relpath in view.ours or relpath in restored:
                continue
            recorded = env.recorded_hash(relpath)
            if recorded != record_digest(current[relpath] or b""):
                why = "not listed in RECORD" if recorded is None else "its sha256 differs from RECORD"
                raise Refused(
                    f"refusing to patch {relpath}",
                    f"{why} (changed by hand, or another tool patched it)",
                    f"{env.reinstall()}; or apply --force to patch it as it is",
                )
    if dry_run:
        diff = b"".join(unified_diff(rel, current[rel] or b"", data) for rel, data in planned.items())
        report = _report(
            env, command, reports, view, EXIT_OK, f"dry run, {len(planned)} file(s) would change",
            diff=diff.decode("utf-8", "surrogateescape"), notes=notes, store=store,
        )
        return replace(report, build=build_identity(env, view))
    new_opt_in = sorted(with_ids - _opt_in_kept(view))
    if not planned and not (new_opt_in and view.kind == "current"):
        if view.kind == "stale":
            store.remove()
            notes.append("removed the stale state")
        elif view.kind == "current" and not view.modified and not _recorded_judgement_holds(env):
            if _refresh_recorded_judgement(env, store, view, patches):
                notes.append("recorded this build's verdicts for verify and the serve guard")
        report = _report(env, command, reports, view, EXIT_OK, "nothing to do", notes=notes, store=store)
        return replace(report, build=build_identity(env, view))

    previous = view.manifest if view.kind == "current" else None
    if view.kind == "stale":
        store.remove()
    manifest = Manifest(vllm_version=env.vllm_version, tool_version=__version__)
    if previous is not None:
        manifest.files = _copied_files(previous)
    manifest.opt_in = sorted(asked & {p.id for p in patches if p.opt_in})
    for relpath, data in planned.items():
        entry = manifest.files.get(relpath)
        if entry is None:
            before = restored.get(relpath, current[relpath])
            entry = manifest.files[relpath] = FileEntry(before=sha256_bytes(before), after="", patches=[])
        entry.after = sha256_bytes(data)
        entry.patches = sorted(set(entry.patches) | set(owners.get(relpath, ())))
    final_reports = _record_judgement(env, view, manifest, patches, planned)
    saved = _save_local_edits(env, store, [r.relpath for r in restores])
    write_apply(env, store, previous, manifest, planned, originals=restored)
    final = read_state(env, store)
    taken = f"took over {len(restores)} file(s), " if takeover else ""
    return replace(
        _report(env, command, final_reports, final, EXIT_OK, f"{taken}patched {len(planned)} file(s)",
                changed=planned, notes=notes, store=store),
        build=build_identity(env, final), saved_edits=tuple(saved),
    )


def _save_local_edits(env: Environment, store: StateStore, relpaths: list[str]) -> list[str]:
    """Save each file (as it is now) in a fresh run directory under saved-edits/; where each was saved.

    Each is read only where it resolves inside the package, and saved with its own owner and mode.
    """
    if not relpaths:
        return []
    copies = []
    for relpath in relpaths:
        try:
            copies.append((relpath, *env.tree.read_contained(relpath)))
        except UnsafePath as exc:
            raise Refused(f"refusing to save {relpath}", exc.why or exc.what, env.reinstall()) from None
    run = store.new_saved_edits_run()
    return [str(store.save_local_edit(run, relpath, data, owner)) for relpath, data, owner in copies]


def _differs_from_record(env: Environment, relpath: str) -> bool:
    data = env.read_bytes(relpath)
    return data is not None and env.recorded_hash(relpath) not in (None, record_digest(data))


def _unrecorded_notes(judgement: Judgement, view: StateView, restored: dict[str, bytes] | None = None) -> list[str]:
    """A file that is not what pip installed, said once: it changes no verdict, but guards the writes."""
    return [
        f"{why}: each patch is judged from its own code there; apply writes it only with --force"
        for rel, why in judgement.unrecorded.items()
        if rel not in view.ours and rel not in (restored or {})
    ]


def _refusal(env, judgement, blocked, chosen, force) -> Refused:
    """Why apply will not write, in a few words, and the one command that gets past it."""
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
            takeover_next(env, judgement),
        )
    edit = next((e for e in first.edits if e.verdict is first.verdict), None)
    why = edit.detail if edit is not None else first.detail
    others = "; apply the others with --only" if len(blocked) < len(chosen) else ""
    if edit is not None and "cannot be judged" in edit.detail:
        return Refused(
            f"refusing to apply: {first.id} cannot be judged", why.replace(PACKAGE_PREFIX, ""),
            f"{env.reinstall()}, then patch-dsv4 apply{env.target.args()}",
        )
    return Refused(
        f"refusing to apply: {first.id} is drifted", why.replace(PACKAGE_PREFIX, ""),
        f"patch-dsv4 status -v{env.target.args()}{others}",
    )


def _plan(env, store, view, patches, chosen, judgement, ctx) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """The new bytes of every file the chosen patches change, and which patches own each file.

    Planned from the one judgement; files we wrote whose edits the patches now
    write differently are planned again from their backups (the release's
    bytes), with every patch we applied to them.
    """
    replan = {
        edit.file
        for pairs in judgement.outcomes.values()
        for edit, outcome in pairs
        if outcome.verdict is Verdict.DRIFTED and edit.file in view.ours
    }
    wanted = set(chosen)
    if replan:
        for relpath in replan:
            wanted.update(view.manifest.files[relpath].patches)
        plan_j = _replan(env, store, view, [p for p in patches if p.id in wanted], replan)
        planned = dict(plan_j.planned)
    else:
        plan_j = judgement
        planned = plan_files(ctx, judgement, wanted)
    owners: dict[str, list[str]] = {}
    for patch_id, pairs in plan_j.outcomes.items():
        if patch_id not in wanted:
            continue
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.PENDING:
                owners.setdefault(edit.file, [])
                if patch_id not in owners[edit.file]:
                    owners[edit.file].append(patch_id)
            elif outcome.verdict is Verdict.DRIFTED:
                raise Refused(f"refusing to apply: {patch_id} is drifted", outcome.detail, f"patch-dsv4 status{env.target.args()}")
    return planned, owners


def _copied_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The file table of ``manifest``, copied (a new manifest starts from it and may change its entries)."""
    return {rel: FileEntry(e.before, e.after, list(e.patches)) for rel, e in manifest.files.items()}


def _recorded_judgement_holds(env: Environment) -> bool:
    site = quick.site_of(env)
    return quick.recorded_verdicts(site) is not None


def _refresh_recorded_judgement(env: Environment, store: StateStore, view: StateView, patches: list[Patch]) -> bool:
    """Record the judgement of this build (another patch-dsv4, or another FlashInfer, made the last): one atomic
    write, and only when it differs from what is recorded (an apply with nothing to do writes nothing twice).

    Without it, verify and the guard judge in full on every run until a file changes. Whether it wrote.
    """
    previous = view.manifest
    manifest = Manifest(vllm_version=env.vllm_version, tool_version=__version__, opt_in=list(previous.opt_in))
    manifest.files = _copied_files(previous)
    _record_judgement(env, view, manifest, patches, {})
    if manifest.to_json() == previous.to_json():
        return False
    store.save(manifest)
    return True


def _record_judgement(
    env: Environment, view: StateView, manifest: Manifest, patches: list[Patch], planned: dict[str, bytes]
) -> tuple[PatchReport, ...]:
    """Judge the planned tree (as it will be on disk), keep it for verify's fast path, and return it."""
    ctx = context_for(env, view, overlay=planned)
    judgement = judge(ctx, patches, plan=False)
    reports = as_opt_in(_patch_reports(env, judgement, patches, _NO_STATE), patches, set(manifest.opt_in))
    manifest.verdicts = {
        r.id: {
            "title": r.title, "verdict": r.verdict.value, "files": list(r.files), "detail": r.detail,
            "edits": [e.to_json() for e in r.edits],
        }
        for r in reports
    }
    manifest.inputs = {
        rel: (sha256_bytes(planned[rel]) if rel in planned else env.sha256(rel)) for rel in ctx.files_read()
    }
    manifest.flashinfer = {"version": env.flashinfer_version, "source": env.flashinfer_source}
    manifest.patch_digest = patch_digest()
    return reports


# -- revert -------------------------------------------------------------------------------
def revert(env: Environment, lock_timeout: float = 300.0, discard_local_edits: bool = False, on_wait=None) -> Report:
    """Restore every file we patched, byte for byte, and remove the state: all or none.

    A patched file changed since we wrote it is refused, unless
    ``discard_local_edits``: then it is first saved under the state directory
    (the report says where), and restored like the others.
    """
    patches = discover_patches()
    store = state_store(env, patches)
    with store.lock(lock_timeout, on_wait):
        notes = recover(env, store)
        view = read_state(env, store)
        notes += _state_notes(view)
        if view.kind in ("none", "stale"):
            if view.kind == "stale":
                store.remove()
                notes.append("restored nothing from the stale state and removed it")
            elif store.remove_if_empty():
                notes.append(f"removed the empty {STATE_DIR}/ an interrupted run left")
            reports = as_opt_in(_patch_reports(env, judge(context_for(env), patches, plan=False), patches, _NO_STATE), patches, set())
            report = _report(env, "revert", reports, view, EXIT_OK, "nothing to revert", notes=notes)
            return replace(report, build=build_identity(env, _NO_STATE))
        if view.modified and not discard_local_edits:
            relpath = sorted(view.modified)[0]
            raise Refused(
                f"refusing to revert: {relpath} {view.modified[relpath]}",
                "restoring it would lose that edit",
                f"patch-dsv4 revert --discard-local-edits{env.target.args()} (saves your edit first)",
            )
        manifest = view.manifest
        restore, saved = {}, []
        for relpath, entry in manifest.files.items():
            if relpath not in view.ours and relpath not in view.modified:
                continue  # reinstalled since: the release's own file is there already
            backup = store.read_copy("backups", relpath)
            if backup is None or sha256_bytes(backup) != entry.before:
                raise Refused(
                    f"refusing to revert {relpath}",
                    "its backup is missing or does not match the recorded hash",
                    env.reinstall(),
                )
            restore[relpath] = backup
        saved = _save_local_edits(env, store, sorted(view.modified))
        write_revert(env, store, manifest, restore)
        reports = as_opt_in(_patch_reports(env, judge(context_for(env), patches, plan=False), patches, _NO_STATE), patches, set())
        report = _report(
            env, "revert", reports, _NO_STATE, EXIT_OK, f"restored {len(restore)} file(s)", changed=sorted(restore),
            notes=notes,
        )
        return replace(report, saved_edits=tuple(saved), build=build_identity(env, _NO_STATE))
