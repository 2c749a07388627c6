"""Judge a vLLM release before installing it: which patches it needs, which upstream fixed, which drifted.

The judgement is the engine's own (:func:`patch_dsv4.engine.judge` over a
:class:`patch_dsv4.patching.patch.Context`), so ``drift`` on a wheel gives the verdicts
``status`` gives on the installed release. On top of the verdicts, each
anchor's enclosing function is fingerprinted (formatting-blind, see
:mod:`patch_dsv4.patching.fingerprint`) and compared with the fingerprints recorded in
anchors/ for the known releases:

- ``recorded``: seen in a known release;
- ``new``: the anchor still matches (or the patch is upstream / not applicable)
  but the function around it changed: review the patch against it;
- ``drifted``: the edit's anchor no longer matches;
- ``absent``: the function does not exist in this release (and the edit is not drifted).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from patch_dsv4.output.errors import EXIT_NEEDS_ACTION, EXIT_OK, PatcherError
from patch_dsv4.output.verdicts import PatchReport, Report, Verdict
from patch_dsv4.patching.fingerprint import scope_fingerprint
from patch_dsv4.patching.patch import Context, Patch
from patch_dsv4.releases import anchors_store
from patch_dsv4.releases.anchors_store import BuildMatch
from patch_dsv4.releases.release_target import ReleaseTarget

RECORDED, NEW, DRIFTED, ABSENT = "recorded", "new", "drifted", "absent"


@dataclass(frozen=True)
class AnchorPrint:
    """The fingerprint of one edit's enclosing function in the judged release."""

    label: str
    file: str
    scope: str
    verdict: Verdict  # the edit's own verdict
    fingerprint: str | None
    status: str  # recorded | new | drifted | absent
    recorded_in: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "file": self.file,
            "scope": self.scope,
            "verdict": self.verdict.value,
            "fingerprint": self.fingerprint,
            "status": self.status,
            "recorded_in": list(self.recorded_in),
        }


@dataclass(frozen=True)
class DriftReport:
    report: Report  # verdicts, summary and exit status, as for status
    release: str  # what was judged, in words
    anchors: dict[str, tuple[AnchorPrint, ...]]  # patch id -> its edits' fingerprints
    build: BuildMatch
    choices: tuple[str, ...]  # how the versions were chosen
    files_read: tuple[str, ...]
    strict: bool
    flashinfer_given: bool = False  # --flashinfer-version replaced the release's own
    absent_why: dict = field(default_factory=dict)  # (file, scope) of an absent anchor -> what the release lacks

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def to_json(self) -> dict:
        """status's document (``build`` included), with each patch's anchors and how the release was read."""
        data = self.report.to_json()
        for patch in data["patches"]:
            patch["anchors"] = [a.to_json() for a in self.anchors.get(patch["id"], ())]
        data.update(
            {
                "release": self.release,
                "choices": list(self.choices),
                "flashinfer_given": self.flashinfer_given,
                "files_read": list(self.files_read),
                "strict": self.strict,
            }
        )
        return data

    def fingerprint_lines(self, patch_id: str, verbose: bool = False) -> list[str]:
        """The enclosing functions worth a look under a patch's line: new ones and drifted ones (``verbose``: the
        absent ones too, each with what this release lacks)."""
        lines = []
        for a in self.anchors.get(patch_id, ()):
            if a.status in (NEW, DRIFTED):
                lines.append(f"{a.file.rsplit('/', 1)[-1]}:{a.scope} {a.fingerprint or '-'} {a.status}")
            elif verbose and a.status == ABSENT:
                lines.append(self.absent_why.get((a.file, a.scope), f"{a.scope}: absent"))
        return list(dict.fromkeys(lines))

    def markdown_column(self) -> tuple[str, dict[str, str]]:
        """drift's extra markdown column: each anchor's enclosing function and its fingerprint status."""
        cells = {}
        for patch_id, prints in self.anchors.items():
            rows = []
            for a in prints:
                status = a.status + (f" ({', '.join(a.recorded_in)})" if a.recorded_in else "")
                rows.append(f"`{a.file.rsplit('/', 1)[-1]}:{a.scope}` `{a.fingerprint or '-'}` {status}")
            cells[patch_id] = "<br>".join(rows) or "-"
        return "enclosing functions (fingerprint)", cells


@dataclass
class _Judged:
    patches: list[Patch]
    ctx: Context
    reports: tuple[PatchReport, ...]
    pairs: dict[str, list]  # patch id -> [(edit, outcome)]
    originals: dict[str, str | None]


def _judge(target: ReleaseTarget, patches: list[Patch] | None = None) -> _Judged:
    from patch_dsv4.patching.registry import discover_patches
    from patch_dsv4.pipeline.judge import as_opt_in, judge, patch_report

    patches = discover_patches() if patches is None else patches
    ctx = target.context()
    ctx.probe_log = {}  # each probe's answer and the files it read: what a record keeps
    judgement = judge(ctx, patches)
    reports = as_opt_in(tuple(patch_report(patch, judgement) for patch in patches), patches, set())
    originals = {rel: ctx.read(rel) for rel in judgement.originals}
    return _Judged(patches, ctx, reports, judgement.outcomes, originals)


def _fingerprints(judged: _Judged, patch_id: str) -> list[tuple[object, object, str | None]]:
    """(edit, outcome, fingerprint of its enclosing function in the release) for each scoped edit."""
    out = []
    for edit, outcome in judged.pairs[patch_id]:
        text = judged.originals.get(edit.file)
        fp = None if text is None else scope_fingerprint(text, edit.scope.cls, edit.scope.func)
        out.append((edit, outcome, fp))
    return out


def drift(target: ReleaseTarget, strict: bool = False, anchors_dir=None) -> DriftReport:
    """Judge ``target`` and compare each anchor's enclosing function with the recorded ones."""
    judged = _judge(target)
    records = anchors_store.load_all(anchors_dir)
    known = anchors_store.known_fingerprints(records)
    prints: dict[str, tuple[AnchorPrint, ...]] = {}
    absent_why: dict[tuple[str, str], str] = {}
    for report in judged.reports:
        rows = []
        for edit, outcome, fp in _fingerprints(judged, report.id):
            scope = str(edit.scope)
            recorded_in = tuple(known.get((edit.file, scope), {}).get(fp, ())) if fp else ()
            if outcome.verdict is Verdict.DRIFTED:
                status = DRIFTED
            elif fp is None:
                status = ABSENT
            elif recorded_in:
                status = RECORDED
            else:
                status = NEW
            rows.append(AnchorPrint(edit.label, edit.file, scope, outcome.verdict, fp, status, recorded_in))
            if status == ABSENT:
                where = _short(edit.file) if judged.originals.get(edit.file) is None else scope
                absent_why[(edit.file, scope)] = f"{where}: absent from this release"
        prints[report.id] = tuple(rows)

    files_read = tuple(judged.ctx.files_read())
    hashes = {rel: _sha256(target, rel) for rel in files_read}
    build = anchors_store.known_release(
        target.vllm_version,
        lambda rel: hashes[rel] if rel in hashes else _sha256(target, rel),
        anchors_dir,
        files=target.package_files(),
    )

    notes = list(target.notes)
    notes.append(build.detail)
    record = records.get(target.vllm_version)
    if build.known and record is not None:
        for report in judged.reports:
            entry = record["patches"].get(report.id, {})
            was = "opt-in" if entry.get("opt_in") and entry.get("verdict") == "pending" else entry.get("verdict")
            if was != report.verdict.value:
                notes.append(
                    f"{report.id}: {report.verdict.value} now, {was or 'no record'} when anchors/ was recorded "
                    f"for this release (re-record: {anchors_store.RECORD_COMMAND})"
                )

    if not (build.known and record is not None):
        notes += changes_since_nearest(target.vllm_version, judged, records)

    all_prints = [a for rows in prints.values() for a in rows]
    drifted = [r for r in judged.reports if r.verdict is Verdict.DRIFTED]
    new = [a for a in all_prints if a.status == NEW]
    exit_code = EXIT_NEEDS_ACTION if drifted or (strict and new) else EXIT_OK
    counts: dict[str, int] = {}
    for r in judged.reports:
        counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
    fp_counts: dict[str, int] = {}
    for a in all_prints:
        fp_counts[a.status] = fp_counts.get(a.status, 0) + 1
    summary = f"drift: vLLM {target.vllm_version}, {'known' if build.known else 'unknown'} build: " + (
        ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patches"
    )
    if drifted:
        summary += f"; FAILED: {', '.join(r.id for r in drifted)} drifted"
    elif strict and new:
        summary += "; FAILED (--strict): new fingerprints"
    notes.append(_fingerprint_note(fp_counts))
    report = Report(
        command="drift",
        target=target.description,
        vllm_version=target.vllm_version,
        flashinfer_version=target.flashinfer_version,
        flashinfer_source=target.flashinfer_source,
        patches=judged.reports,
        state=None,
        exit_code=exit_code,
        summary=summary,
        notes=tuple(notes),
        build={"known": build.known, "detail": build.detail},
        next_step=(
            "review the patch against the changed code (patch-dsv4 drift -v), then re-record: "
            + anchors_store.RECORD_COMMAND
            if drifted or (strict and new)
            else None
        ),
    )
    return DriftReport(
        report=report,
        release=target.description,
        anchors=prints,
        build=build,
        choices=tuple(target.notes),
        files_read=files_read,
        strict=strict,
        flashinfer_given=target.flashinfer_given,
        absent_why=absent_why,
    )


def _short(relpath: str) -> str:
    """A file as the reports name it (under vllm/models/deepseek_v4/, or its V4.1 package)."""
    from patch_dsv4.output.render import short_path

    return short_path(relpath)


def _fingerprint_note(counts: dict[str, int]) -> str:
    """What the fingerprints of the functions around the anchors say, in words: each count, and what it means."""
    meaning = {
        RECORDED: "as anchors/ records them",
        NEW: "changed since: review the patch there",
        DRIFTED: "where the anchor no longer matches",
        ABSENT: "from this release (another layout's or release's code: -v names each)",
    }
    said = ", ".join(f"{counts[s]} {s} {meaning[s]}" for s in (RECORDED, NEW, DRIFTED, ABSENT) if counts.get(s))
    return f"functions around the anchors: {said or 'none'}"


def nearest_recorded(version: str, records: dict[str, dict]) -> str | None:
    """The recorded release a new one is compared with: the newest not after it, else the oldest."""
    try:
        wanted = Version(version)
    except InvalidVersion:
        return None
    known = sorted((Version(v), v) for v in records if _is_version(v))
    before = [v for parsed, v in known if parsed <= wanted and v != version]
    return before[-1] if before else (known[0][1] if known else None)


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def changes_since_nearest(version: str, judged: _Judged, records: dict[str, dict]) -> list[str]:
    """Per patch whose verdict differs from the nearest recorded release's: what changed and where, as notes.

    Each names the patch's verdicts there and here, every function (file and scope) whose verdict or
    fingerprint changed, before and after, and the evidence now: the release-day review starts from here.
    """
    nearest = nearest_recorded(version, records)
    if nearest is None:
        return []
    notes = []
    for report in judged.reports:
        entry = records[nearest]["patches"].get(report.id)
        if entry is None:
            notes.append(f"{report.id}: {report.verdict.value} on vLLM {version}; vLLM {nearest} has no record of it")
            continue
        was = "opt-in" if entry.get("opt_in") and entry.get("verdict") == "pending" else entry.get("verdict")
        if was == report.verdict.value:
            continue
        recorded = {(a["file"], a["scope"]): a for a in entry.get("anchors", ())}
        changed = []
        for edit, outcome, fp in _fingerprints(judged, report.id):
            before = recorded.get((edit.file, str(edit.scope)), {})
            if before.get("verdict") == outcome.verdict.value and before.get("fingerprint") == fp:
                continue
            changed.append(
                f"{edit.file}:{edit.scope} was {before.get('verdict', 'not recorded')} "
                f"({before.get('fingerprint') or 'absent'}), is {outcome.verdict.value} ({fp or 'absent'})"
            )
        notes.append(
            f"{report.id}: {report.verdict.value} on vLLM {version}, {was} on vLLM {nearest} (the nearest recorded "
            f"release); " + ("; ".join(changed) or "the same functions, judged differently") + f"; now: {report.detail}"
        )
    return notes


def _sha256(target: ReleaseTarget, relpath: str) -> str | None:
    try:
        data = target.read_bytes(relpath)
    except (OSError, PatcherError):
        return None
    return None if data is None else hashlib.sha256(data).hexdigest()


def record(target: ReleaseTarget, wheel_name: str | None = None) -> dict:
    """The anchors/ record of a release: verdicts, fingerprints, and the hash of every file read."""
    judged = _judge(target)
    opt_in = {p.id for p in judged.patches if p.opt_in}
    patches = {}
    for report in judged.reports:
        patches[report.id] = {
            # an opt-in patch is recorded with its verdict as judged (pending where it would apply)
            "verdict": "pending" if report.verdict is Verdict.OPT_IN else report.verdict.value,
            "opt_in": report.id in opt_in,
            "anchors": [
                {"file": edit.file, "scope": str(edit.scope), "verdict": outcome.verdict.value, "fingerprint": fp}
                for edit, outcome, fp in _fingerprints(judged, report.id)
            ],
        }
    from patch_dsv4.patching.edits import encode_answer

    probes = {
        key: {"files": {rel: _sha256(target, rel) for rel in sorted(reads)}, "answer": encode_answer(answer)}
        for key, (reads, answer) in (judged.ctx.probe_log or {}).items()
    }
    return {
        "schema": anchors_store.SCHEMA_VERSION,
        "vllm_version": target.vllm_version,
        "probes": probes,
        "flashinfer": {"version": target.flashinfer_version, "source": target.flashinfer_source},
        "wheel": wheel_name,
        "files": {rel: _sha256(target, rel) for rel in judged.ctx.files_read()},
        "package_files": target.package_files(),
        "patches": patches,
    }
