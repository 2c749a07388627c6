"""The engine: judge every patch on a target, plan edits in memory, write them safely.

Pure functions over an Environment; the CLI only renders the Reports they return.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field, replace

from patcher import __version__
from patcher.edits import ReplaceStatements
from patcher.environment import Environment, record_digest
from patcher.errors import EXIT_NEEDS_ACTION, EXIT_OK, Refused, TransformBug
from patcher.fingerprint import find_scope
from patcher.patch import Context, Edit, Patch
from patcher.registry import discover_patches
from patcher.resolve import check_injected, local_names
from patcher.state import (
    FileEntry,
    Manifest,
    StateStore,
    _step,
    atomic_write,
    remove_temp_files,
    replace_source,
    sha256_bytes,
    sha256_path,
)
from patcher.verdicts import EditReport, Outcome, PatchReport, Report, Verdict, combine


# -- judging -------------------------------------------------------------------
def context_for(env: Environment) -> Context:
    return Context(
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        read_file=env.read,
        read_flashinfer_file=env.read_flashinfer,
    )


@dataclass
class Judgement:
    """Every edit's outcome on the current files, and the files as the pending edits would leave them."""

    outcomes: dict[str, list[tuple[Edit, Outcome]]]  # patch id -> edits
    originals: dict[str, str | None]
    planned: dict[str, str] = field(default_factory=dict)  # only files that change

    def patch_files(self, patch_id: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(edit.file for edit, _ in self.outcomes[patch_id]))


def _check_names(ctx: Context, edit: Edit, text: str) -> list[str]:
    scope_names: set[str] = set()
    if isinstance(edit, ReplaceStatements):
        scope = find_scope(ast.parse(text), edit.scope.cls, edit.scope.func)
        if scope is not None:
            scope_names = local_names(scope)
    return check_injected(ctx, edit.file, edit.injected_code(), scope_names)


def judge(ctx: Context, patches: list[Patch]) -> Judgement:
    """Run every edit in order, each on the text the previous ones planned for its file."""
    outcomes: dict[str, list[tuple[Edit, Outcome]]] = {}
    originals: dict[str, str | None] = {}
    current: dict[str, str | None] = {}
    for patch in patches:
        outcomes[patch.id] = []
        for edit in patch.edits(ctx):
            if edit.file not in current:
                originals[edit.file] = current[edit.file] = ctx.read(edit.file)
            outcome = edit.evaluate(ctx, current[edit.file])
            if outcome.verdict is Verdict.PENDING:
                problems = _check_names(ctx, edit, current[edit.file] or "")
                if problems:
                    outcome = Outcome.drifted(
                        f"{edit.label}: the injected code does not fit this release: " + "; ".join(problems)
                    )
                else:
                    current[edit.file] = outcome.new_text
            outcomes[patch.id].append((edit, outcome))
    planned = {f: t for f, t in current.items() if t is not None and t != originals[f]}
    judgement = Judgement(outcomes, originals, planned)
    _prove_idempotent(ctx, judgement)
    return judgement


def _prove_idempotent(ctx: Context, judgement: Judgement) -> None:
    """Each planned file parses, and running every edit on it again changes nothing."""
    for path, text in judgement.planned.items():
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


# -- state ---------------------------------------------------------------------
@dataclass
class StateView:
    manifest: Manifest | None
    kind: str  # "none" | "current" | "stale" | "interrupted"
    modified: dict[str, str]  # relpath -> why
    ours: set[str]  # files that are as we wrote them


_NO_STATE = StateView(None, "none", {}, set())


def read_state(env: Environment, store: StateStore) -> StateView:
    manifest = store.load()
    if manifest is None:
        return StateView(None, "none", {}, set())
    if manifest.vllm_version != env.vllm_version:
        return StateView(manifest, "stale", {}, set())
    modified, ours, reinstalled = {}, set(), 0
    for relpath, entry in manifest.files.items():
        now = sha256_path(env.path(relpath))
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


# -- reports ---------------------------------------------------------------------
def _patch_reports(judgement: Judgement, patches: list[Patch], view: StateView) -> tuple[PatchReport, ...]:
    reports = []
    for patch in patches:
        pairs = judgement.outcomes[patch.id]
        edits = []
        for edit, outcome in pairs:
            verdict, detail = outcome.verdict, outcome.detail
            if view.kind in ("current", "interrupted") and edit.file in view.modified:
                entry = view.manifest.files[edit.file]
                if patch.id in entry.patches:
                    verdict = Verdict.MODIFIED
                    detail = f"{edit.file} {view.modified[edit.file]} (was {outcome.verdict.value}: {outcome.detail})"
            edits.append(EditReport(edit.label, edit.file, verdict, detail, outcome.expected, outcome.found))
        verdict = combine([e.verdict for e in edits])
        focus = [e for e in edits if e.verdict is verdict]
        detail = "; ".join(dict.fromkeys(e.detail for e in focus)) if focus else "no edits"
        reports.append(PatchReport(patch.id, patch.title, verdict, judgement.patch_files(patch.id), detail, tuple(edits)))
    return tuple(reports)


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
        return [
            f"state written for vLLM {view.manifest.vllm_version} is stale: its backups will never be restored"
        ]
    if view.kind == "interrupted":
        return ["an earlier apply or revert was interrupted; the next apply or revert finishes it"]
    return []


def select(patches: list[Patch], only: list[str] | None) -> list[Patch]:
    if not only:
        return patches
    known = {p.id for p in patches}
    unknown = [i for i in only if i not in known]
    if unknown:
        from patcher.errors import EnvironmentProblem

        raise EnvironmentProblem(
            f"unknown patch id {', '.join(unknown)}", f"known: {', '.join(sorted(known))}", "patch-dsv4 list"
        )
    return [p for p in patches if p.id in only]


# -- commands ----------------------------------------------------------------------
def status(env: Environment, command: str = "status") -> Report:
    patches = discover_patches()
    store = StateStore(env.site_packages)
    view = read_state(env, store)
    judgement = judge(context_for(env), patches)
    reports = _patch_reports(judgement, patches, view)
    report = _report(env, command, reports, view, EXIT_OK, notes=_state_notes(view))
    return replace(report, build=build_identity(env, view))


def build_identity(env: Environment, view: StateView) -> dict:
    """Whether this vLLM build is a release recorded in anchors/ (files we patched count as they were)."""
    from patcher.anchors_store import known_release

    def as_installed(relpath: str) -> str | None:
        entry = view.manifest.files.get(relpath) if view.kind == "current" else None
        if entry is not None and relpath in view.ours:
            return entry.before
        return sha256_path(env.path(relpath))

    match = known_release(env.vllm_version, as_installed)
    return {"known": match.known, "detail": match.detail}


def _fast_verdicts(env: Environment, view: StateView) -> tuple[PatchReport, ...] | None:
    """The verdicts recorded at the last write, when nothing they were based on has changed."""
    manifest = view.manifest
    if view.kind != "current" or view.modified or not manifest.verdicts:
        return None
    if manifest.tool_version != __version__:
        return None
    if manifest.flashinfer != {"version": env.flashinfer_version, "source": env.flashinfer_source}:
        return None
    for relpath, sha in manifest.inputs.items():
        if sha256_path(env.path(relpath)) != sha:
            return None
    if sorted(manifest.verdicts) != sorted(p.id for p in discover_patches()):
        return None
    return tuple(
        PatchReport(pid, v["title"], Verdict(v["verdict"]), tuple(v["files"]), v["detail"])
        for pid, v in manifest.verdicts.items()
    )


def verify(env: Environment) -> Report:
    store = StateStore(env.site_packages)
    view = read_state(env, store)
    reports = _fast_verdicts(env, view)
    extra = "hashes match the recorded state" if reports is not None else ""
    if reports is None:
        return _verify_report(status(env, command="verify"))
    bad = [r for r in reports if r.verdict.needs_action]
    return _report(env, "verify", reports, view, EXIT_NEEDS_ACTION if bad else EXIT_OK, extra)


def _verify_report(report: Report) -> Report:
    bad = [r for r in report.patches if r.verdict.needs_action]
    return Report(**{**report.__dict__, "exit_code": EXIT_NEEDS_ACTION if bad else EXIT_OK})


def unified_diff(relpath: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{relpath}", f"b/{relpath}"
        )
    )


def apply(
    env: Environment,
    only: list[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    lock_timeout: float = 300.0,
) -> Report:
    store = StateStore(env.site_packages)
    if dry_run:
        return _apply_locked(env, store, only, force, dry_run=True)
    with store.lock(lock_timeout):
        recover(env, store)
        return _apply_locked(env, store, only, force, dry_run=False)


def _apply_locked(env, store, only, force, dry_run) -> Report:
    patches = discover_patches()
    selected = select(patches, only)
    view = read_state(env, store)
    ctx = context_for(env)
    judgement = judge(ctx, patches)
    reports = _patch_reports(judgement, patches, view)
    chosen = {p.id for p in selected}
    notes = _state_notes(view)

    blocked = [r for r in reports if r.id in chosen and r.verdict in (Verdict.DRIFTED, Verdict.MODIFIED)]
    if blocked:
        first = blocked[0]
        raise Refused(
            f"refusing to apply: {first.id} is {first.verdict.value}",
            first.detail,
            "patch-dsv4 status for details"
            + ("; apply the others with --only" if len(blocked) < len(chosen) else ""),
        )
    plan_j = judge(ctx, selected) if only else judgement
    planned = plan_j.planned
    _step("judged")
    if not force and not dry_run:
        for relpath in planned:
            if relpath in view.ours:
                continue
            data = env.path(relpath).read_bytes()
            recorded = env.recorded_hash(relpath)
            if recorded != record_digest(data):
                why = "not listed in RECORD" if recorded is None else "its sha256 differs from RECORD"
                raise Refused(
                    f"refusing to patch {relpath}",
                    f"{why} (changed by hand, or another tool patched it)",
                    f"pip install --force-reinstall --no-deps vllm=={env.vllm_version}, or apply --force",
                )
    diff = "".join(unified_diff(p, plan_j.originals[p] or "", t) for p, t in planned.items())
    if dry_run:
        return _report(
            env, "apply", reports, view, EXIT_OK, f"dry run, {len(planned)} file(s) would change", diff=diff, notes=notes
        )
    if not planned:
        if view.kind == "stale":
            store.remove()
            notes.append("removed the stale state")
        return _report(env, "apply", reports, view, EXIT_OK, "nothing to do", notes=notes)

    manifest = view.manifest if view.kind == "current" else None
    if view.kind == "stale":
        store.remove()
    manifest = manifest or Manifest(vllm_version=env.vllm_version, tool_version=__version__)
    owners: dict[str, list[str]] = {}
    for patch in selected:
        for edit, outcome in plan_j.outcomes[patch.id]:
            if outcome.verdict is Verdict.PENDING:
                owners.setdefault(edit.file, [])
                if patch.id not in owners[edit.file]:
                    owners[edit.file].append(patch.id)
    transaction = {"op": "apply", "files": {}}
    for relpath, text in planned.items():
        current = env.path(relpath).read_bytes()
        new = text.encode()
        if relpath not in manifest.files:
            atomic_write(store.backup_path(relpath), current)
            _step("backup")
            manifest.files[relpath] = FileEntry(before=sha256_bytes(current), after="", patches=[])
        entry = manifest.files[relpath]
        entry.after = sha256_bytes(new)
        entry.patches = sorted(set(entry.patches) | set(owners.get(relpath, [])))
        atomic_write(store.staged_path(relpath), new)
        _step("staged")
        transaction["files"][relpath] = {"from": sha256_bytes(current), "to": entry.after}
    manifest.vllm_version = env.vllm_version
    manifest.tool_version = __version__
    manifest.transaction = transaction
    _record_judgement(env, manifest, patches, planned)
    store.save(manifest)
    _step("journal")
    _roll_forward(env, store, manifest)
    final = read_state(env, store)
    final_reports = _patch_reports(judge(context_for(env), patches), patches, final)
    return _report(
        env, "apply", final_reports, final, EXIT_OK, f"patched {len(planned)} file(s)", changed=planned, notes=notes
    )


def _record_judgement(env: Environment, manifest: Manifest, patches: list[Patch], planned: dict[str, str]) -> None:
    """Judge the planned tree (as it will be on disk) and keep it for verify's fast path."""
    overlay = dict(planned)
    ctx = Context(
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        read_file=lambda rel: overlay[rel] if rel in overlay else env.read(rel),
        read_flashinfer_file=env.read_flashinfer,
    )
    judgement = judge(ctx, patches)
    manifest.verdicts = {
        r.id: {"title": r.title, "verdict": r.verdict.value, "files": list(r.files), "detail": r.detail}
        for r in _patch_reports(judgement, patches, _NO_STATE)
    }
    manifest.inputs = {
        rel: (sha256_bytes(overlay[rel].encode()) if rel in overlay else sha256_path(env.path(rel)))
        for rel in ctx.files_read()
    }
    manifest.flashinfer = {"version": env.flashinfer_version, "source": env.flashinfer_source}


def _replay(env: Environment, manifest: Manifest, source) -> None:
    """Move each file of the journalled transaction to its "to" bytes, read from ``source(relpath)``.

    A file already there is left alone; one that is neither "from" nor "to"
    changed behind our back and stops the replay, nothing more written.
    """
    op = manifest.transaction["op"]
    for relpath, move in manifest.transaction["files"].items():
        now = sha256_path(env.path(relpath))
        if now == move["to"]:
            continue
        if now != move["from"]:
            raise Refused(
                f"cannot finish the interrupted {op} of {relpath}",
                "the file changed since",
                f"pip install --force-reinstall --no-deps vllm=={env.vllm_version}, then patch-dsv4 {op}",
            )
        data = source(relpath)
        if sha256_bytes(data) != move["to"]:
            raise Refused(f"the saved copy of {relpath} is damaged", "", f"reinstall vllm=={env.vllm_version}")
        replace_source(env.path(relpath), data)
        _step("target")


def _roll_forward(env: Environment, store: StateStore, manifest: Manifest) -> None:
    _replay(env, manifest, lambda relpath: store.staged_path(relpath).read_bytes())
    manifest.transaction = None
    store.save(manifest)
    store.clear_staged()


def recover(env: Environment, store: StateStore) -> None:
    """Finish what a killed apply or revert started (call with the lock held)."""
    manifest = store.load()
    if manifest is None:
        # A run killed before its journal was written: nothing refers to what it left.
        if store.dir.exists():
            store.remove()
        return
    for relpath in {*manifest.files, *(manifest.transaction or {}).get("files", {})}:
        remove_temp_files(env.path(relpath))
    if manifest.transaction is None:
        store.clear_staged()
        return
    if manifest.transaction["op"] == "apply":
        _roll_forward(env, store, manifest)
    else:
        _finish_revert(env, store, manifest)


def revert(env: Environment, lock_timeout: float = 300.0) -> Report:
    store = StateStore(env.site_packages)
    with store.lock(lock_timeout):
        recover(env, store)
        patches = discover_patches()
        view = read_state(env, store)
        notes = _state_notes(view)
        if view.kind == "none":
            reports = _patch_reports(judge(context_for(env), patches), patches, view)
            return _report(env, "revert", reports, view, EXIT_OK, "nothing to revert", notes=notes)
        if view.kind == "stale":
            store.remove()
            reports = _patch_reports(judge(context_for(env), patches), patches, _NO_STATE)
            notes.append("restored nothing from the stale state and removed it")
            return _report(env, "revert", reports, view, EXIT_OK, "nothing to revert", notes=notes)
        if view.modified:
            relpath = sorted(view.modified)[0]
            raise Refused(
                f"refusing to revert: {relpath} {view.modified[relpath]}",
                "restoring it would lose that edit",
                f"pip install --force-reinstall --no-deps vllm=={env.vllm_version} restores the release",
            )
        manifest = view.manifest
        moves = {}
        for relpath, entry in manifest.files.items():
            if relpath in view.ours:
                backup = store.backup_path(relpath)
                if sha256_path(backup) != entry.before:
                    raise Refused(
                        f"refusing to revert {relpath}",
                        "its backup does not match the recorded hash",
                        f"pip install --force-reinstall --no-deps vllm=={env.vllm_version}",
                    )
                moves[relpath] = {"from": entry.after, "to": entry.before}
        manifest.transaction = {"op": "revert", "files": moves}
        store.save(manifest)
        _step("journal")
        _finish_revert(env, store, manifest)
        reports = _patch_reports(judge(context_for(env), patches), patches, read_state(env, store))
        return _report(
            env, "revert", reports, _NO_STATE, EXIT_OK,
            f"restored {len(moves)} file(s)", changed=sorted(moves), notes=notes,
        )


def _finish_revert(env: Environment, store: StateStore, manifest: Manifest) -> None:
    _replay(env, manifest, lambda relpath: store.backup_path(relpath).read_bytes())
    store.remove()
