"""Reports: the :class:`patch_dsv4.output.verdicts.Report` each command returns, made from its judged snapshot or its
plan (the CLI renders it: :mod:`patch_dsv4.output.render`). Nothing here reads: the hashes and the state it names are
what the snapshot holds, and what the plan did to them."""

from __future__ import annotations

import difflib
from dataclasses import replace

from patch_dsv4.fastpath import serving
from patch_dsv4.output.errors import EXIT_OK
from patch_dsv4.output.verdicts import PatchReport, Report, Verdict, next_step, summary_line
from patch_dsv4.pipeline.values import (
    Committed,
    Judged,
    Plan,
    Snapshot,
    as_opt_in,
    state_notes,
    unrecorded_notes,
    unreplaceable_notes,
)


def report(
    state: Snapshot,
    command: str,
    reports: tuple[PatchReport, ...],
    kind: str,
    extra: str = "",
    changed=(),
    diff: str | None = None,
    notes=(),
    backups: bool = True,
    manifest_left: bool | None = None,
) -> Report:
    """``manifest_left``: whether the command leaves a manifest (default: whether it found one)."""
    env = state.env
    store = state.store
    if manifest_left is None:
        manifest_left = state.view.manifest is not None
    return Report(
        command=command,
        target=str(env.site_packages),
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        patches=reports,
        state=kind,
        exit_code=EXIT_OK,
        summary=summary_line(command, reports, extra),
        changed_files=tuple(changed),
        diff=diff,
        notes=tuple(notes),
        backups=str(store.dir_path / "backups") if backups and manifest_left else None,
        hooks=tuple(hook.to_json() for hook in state.hooks),
    )


def status_report(
    state: Snapshot, judged: Judged, command: str = "status", asked=frozenset(), lost_notes=(), rebuilt=frozenset()
) -> Report:
    """The verdicts of the state as judged; the way out named where another tool's edit stands.

    ``asked``: opt-ins asked for besides those the state keeps (verify --with, PATCH_DSV4_WITH). ``lost_notes``:
    what the next apply or revert does to a state without a manifest (patch_dsv4.pipeline.planning.lost_note);
    ``rebuilt``: the files that rebuild names as ours (not said to need --force: apply takes them back as ours).
    """
    opt_in = state.opt_in_kept | set(asked)
    reports = as_opt_in(judged.reports, state.patches, opt_in)
    notes = [
        *state_notes(state.view),
        *lost_notes,
        *unrecorded_notes(judged.now, replace(state.view, ours=state.view.ours | set(rebuilt))),
        *unreplaceable_notes(state),
        *(hook.note(str(state.env.site_packages)) for hook in state.hooks),
    ]
    out = report(state, command, reports, state.kind, notes=notes)
    bad = [r for r in reports if r.verdict.needs_action]
    if any(r.verdict is Verdict.FOREIGN for r in bad):  # the way out is not apply: say which it is
        out = replace(out, next_step=next_step(state.env.target.args(), bad, judged.way_out))
    return replace(out, build=state.build_identity(), fingerprint=judged_fingerprint(state, judged, reports, opt_in))


def judged_fingerprint(state: Snapshot, judged: Judged, reports, opt_in) -> serving.Fingerprint:
    """What the tree as judged serves: ``reports``' verdicts, and every file the judgement read as it was read."""
    files = {rel: state.held_sha256(rel) for rel in judged.ctx.files_read()}
    return serving.of_judged(state.env, state.build.served, opt_in, reports, files)


def dry_run_report(plan: Plan) -> Report:
    """What apply would do: the verdicts as judged, and the plan's files as one unified diff."""
    state = plan.state
    diff = b"".join(unified_diff(rel, plan.old[rel] or b"", data) for rel, data in plan.new.items())
    out = report(
        state,
        plan.command,
        plan.reports,
        state.kind,
        f"dry run, {len(plan.new)} file(s) would change",
        diff=diff.decode("utf-8", "surrogateescape"),
        notes=plan.notes,
    )
    return replace(out, build=state.build_identity())


def refused_report(plan: Plan) -> Report:
    """What a refused apply found: the verdicts it refused on, and the way out the refusal names."""
    state = plan.state
    out = report(state, plan.command, plan.reports, state.kind, notes=plan.notes)
    return replace(out, build=state.build_identity(), next_step=plan.refusal.next_step or None)


def committed_report(plan: Plan, committed: Committed) -> Report:
    """What apply or revert did: the plan's verdicts as they now stand on disk."""
    state = plan.state
    notes = [*plan.notes, *committed.notes]
    if plan.command == "revert":
        kind = state.kind if plan.previous is None else "none"
        out = report(state, "revert", plan.after, kind, plan.summary, sorted(plan.new), notes=notes, backups=False)
        return replace(out, saved_edits=committed.saved_edits, build=state.build_identity(plan.installed_after))
    served = serving.of_manifest(state.env, state.build.served, plan.manifest) if plan.manifest is not None else None
    if not plan.writes:
        left = plan.manifest is not None or (state.view.manifest is not None and not plan.remove_state)
        out = report(state, plan.command, plan.reports, state.kind, plan.summary, notes=notes, manifest_left=left)
        return replace(out, build=state.build_identity(), fingerprint=served)
    out = report(
        state, plan.command, plan.after, "current", plan.summary, changed=plan.new, notes=notes, manifest_left=True
    )
    return replace(
        out, build=state.build_identity(plan.installed_after), saved_edits=committed.saved_edits, fingerprint=served
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
