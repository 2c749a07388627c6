"""Reports for people (text), machines (json) and pull requests or issues (markdown).

One renderer for every command's report (status, verify, apply, revert and
drift): a line per patch that fits the terminal (80 columns included), the
evidence only where it explains something, each sentence once, and a closing
line. Plain text whenever stdout is not a terminal; colour only on a terminal,
and never with ``NO_COLOR``. Nothing here imports rich or libcst.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import dataclass
from collections.abc import Callable
from io import TextIOBase as TextIO  # not typing: importing typing costs verify 2 ms

from patch_dsv4.verdicts import PatchReport, Report

PACKAGE_PREFIX = "vllm/models/deepseek_v4/"
#: Verdicts whose evidence explains something by default (the rest only with -v).
EXPLAINED = ("upstream", "drifted", "modified", "foreign")
_COLOURS = {
    "applied": "32", "upstream": "36", "pending": "33", "drifted": "31", "modified": "31", "opt-in": "2", "foreign": "31",
}


@dataclass(frozen=True)
class Style:
    """How human output looks on this stream: its width, colour, and how much to say."""

    width: int = 80
    colour: bool = False
    verbosity: int = 0  # -1 quiet (closing line only), 0 normal, 1 verbose

    @classmethod
    def for_stream(cls, stream: TextIO, verbosity: int = 0) -> "Style":
        tty = hasattr(stream, "isatty") and stream.isatty()
        width = _terminal_width(stream) if tty else 80
        colour = tty and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
        return cls(max(40, width), colour, verbosity)

    def paint(self, text: str, verdict: str) -> str:
        code = _COLOURS.get(verdict)
        return f"\033[{code}m{text}\033[0m" if self.colour and code else text


def _terminal_width(stream: TextIO) -> int:
    """$COLUMNS, else the terminal's width, else 80 (shutil.get_terminal_size's rule, without importing shutil)."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return 80


def short_path(relpath: str) -> str:
    """A file of the DeepSeek-V4 package without the prefix every one of them shares."""
    return relpath[len(PACKAGE_PREFIX) :] if relpath.startswith(PACKAGE_PREFIX) else relpath


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """Wrapped at spaces only: a path is never folded."""
    return textwrap.wrap(
        text, width=width, initial_indent=indent, subsequent_indent=indent,
        break_long_words=False, break_on_hyphens=False,
    ) or [indent.rstrip()]


def _wrap_fitting(text: str, width: int, indent: str, fallback: str = "  ") -> list[str]:
    """Wrapped at ``indent``; if a word (a long path) cannot fit there, at the smaller ``fallback`` indent."""
    lines = _wrap(text, width, indent)
    if all(len(line) <= width for line in lines):
        return lines
    return _wrap(text, width, fallback)


def _evidence(patch: PatchReport, verbose: bool) -> list[str]:
    """The sentences that explain a verdict, each once (all of them with -v)."""
    if not verbose and patch.verdict.value not in EXPLAINED:
        return []
    sentences = [e.detail for e in patch.edits if verbose or e.verdict is patch.verdict] or [patch.detail]
    return _merge_shared_reasons(list(dict.fromkeys(s.replace(PACKAGE_PREFIX, "") for s in sentences if s)))


def _merge_shared_reasons(sentences: list[str]) -> list[str]:
    """``a: why`` and ``b: why`` become ``a; b: why``: one reason is said once, after everything it explains."""
    subjects: dict[str, list[str]] = {}
    order: list[str] = []
    for sentence in sentences:
        subject, sep, reason = sentence.partition(": ")
        key = reason if sep else sentence
        if key not in subjects:
            subjects[key] = []
            order.append(key)
        if sep:
            subjects[key].append(subject)
    return [f"{'; '.join(subjects[key])}: {key}" if subjects[key] else key for key in order]


def text_lines(report: Report, style: Style, per_patch: Callable[[str], list[str]] | None = None) -> list[str]:
    """The human form of a report, as lines (``per_patch`` adds lines under a patch: drift's fingerprints)."""
    if style.verbosity < 0:
        return [report.summary]
    fi = report.flashinfer_version or "none"
    if report.flashinfer_source:
        fi += f", {report.flashinfer_source}"
    lines = _wrap(f"vLLM {report.vllm_version} (FlashInfer {fi}) at {report.target}", style.width, "")
    facts = []
    if report.build is not None:
        facts.append("known build" if report.build["known"] else "unknown build")
    if report.state is not None:
        facts.append(f"state: {report.state}")
    if facts:
        lines.append("; ".join(facts))
    id_width = max((len(p.id) for p in report.patches), default=0) + 2
    verdict_width = max((len(p.verdict.value) for p in report.patches), default=0) + 2
    for patch in report.patches:
        head = f"  {patch.id:<{id_width}}"
        verdict = patch.shown_verdict
        files = ", ".join(short_path(f) for f in patch.files) or "-"
        room = style.width - len(head) - verdict_width
        if len(files) <= room and len(verdict) < verdict_width:
            lines.append(head + style.paint(f"{verdict:<{verdict_width}}", patch.verdict.value) + files)
        else:
            lines.append(head + style.paint(verdict, patch.verdict.value))
            lines.extend(_wrap(files, style.width, " " * (len(head) + verdict_width)))
        for sentence in _evidence(patch, style.verbosity > 0):
            lines.extend(_wrap_fitting(sentence, style.width, "      "))
        for extra in per_patch(patch.id) if per_patch is not None else ():
            lines.extend(_wrap_fitting(extra, style.width, "      "))
        for edit in patch.edits:
            if edit.verdict.value in ("drifted", "modified") and edit.expected is not None and (
                style.verbosity > 0 or (edit.found is not None and edit.found not in edit.detail)
            ):
                lines.append(f"      in {short_path(edit.file)}:{edit.scope}, expected:")
                lines.extend("        " + line for line in edit.expected.splitlines())
                if edit.found is not None:
                    lines.append("      found:")
                    lines.extend("        " + line for line in edit.found.splitlines()[:12])
    if report.build is not None and (style.verbosity > 0 or not report.build["known"]):
        lines.extend(_wrap(report.build["detail"], style.width, ""))
    if report.changed_files:
        lines.append(f"{'restored' if report.command == 'revert' else 'wrote'} {len(report.changed_files)} file(s):")
        lines.extend(f"  {relpath}" for relpath in report.changed_files)
    if report.backups:
        lines.extend(_wrap(f"backups: {report.backups}", style.width, ""))
    for saved in report.saved_edits:
        lines.extend(_wrap(f"your edit is saved as {saved}", style.width, ""))
    for note in report.notes:
        lines.extend(_wrap(f"note: {note}", style.width, ""))
    lines.append(report.summary)
    return lines


def markdown(report: Report, extra_head: str = "", extra_columns: dict[str, str] | None = None) -> str:
    """A report as markdown: a table a patch, evidence in full, notes and the summary."""
    extra_columns = extra_columns or {}
    head = f"**patch-dsv4 {report.command}**: vLLM {report.vllm_version}"
    head += f", FlashInfer {report.flashinfer_version or 'none'}" + (
        f" ({report.flashinfer_source})" if report.flashinfer_source else ""
    )
    if report.build is not None:
        head += f"; {'known' if report.build['known'] else 'unknown'} build"
    columns = ["patch", "verdict", "files", *([extra_head] if extra_head else []), "evidence"]
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for p in report.patches:
        cells = [f"`{p.id}`", p.shown_verdict, "<br>".join(f"`{short_path(f)}`" for f in p.files) or "-"]
        if extra_head:
            cells.append(extra_columns.get(p.id, "-"))
        cells.append(_cell(" ".join(dict.fromkeys(e.detail for e in p.edits)) or p.detail))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for p in report.patches:
        for e in p.edits:
            if e.verdict.value in ("drifted", "modified") and e.expected is not None:
                lines += [f"**{p.id}**: {_cell(e.detail)}", "", "expected:", "```python", e.expected.rstrip("\n"), "```"]
                if e.found is not None:
                    lines += ["found:", "```python", e.found.rstrip("\n"), "```"]
                lines.append("")
    lines.extend(f"- {_cell(note)}" for note in report.notes)
    if report.diff:
        lines += ["", "```diff", report.diff.rstrip("\n"), "```"]
    lines += ["", f"**{report.summary}**", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_json(document: dict, stream: TextIO | None = None) -> None:
    (stream or sys.stdout).write(json.dumps(document, indent=2) + "\n")


def render(document, fmt: str, verbosity: int = 0) -> None:
    """Write a report (or a drift report) to stdout in ``fmt``; an apply --dry-run's diff is stdout's only content."""
    report: Report = getattr(document, "report", document)
    if fmt == "json":
        write_json(document.to_json())
        return
    stream = sys.stdout
    if report.diff is not None and fmt == "table":
        # stdout holds the patch alone (`apply --dry-run > fix.patch`); the report goes to stderr
        sys.stdout.buffer.write(report.diff.encode("utf-8", "surrogateescape")) if hasattr(sys.stdout, "buffer") else (
            sys.stdout.write(report.diff)
        )
        sys.stdout.flush()
        stream = sys.stderr
    if fmt == "markdown":
        stream.write(markdown(report, *getattr(document, "markdown_column", lambda: ("", None))()))
        return
    style = Style.for_stream(stream, verbosity)
    stream.write("\n".join(text_lines(report, style, getattr(document, "fingerprint_lines", None))) + "\n")


def write_failure(report: Report) -> None:
    """On stderr, which patches failed and the command that resolves them (verify's and drift's exit 1)."""
    bad = [p for p in report.patches if p.verdict.needs_action]
    if not bad and not report.next_step:
        return
    for patch in bad:
        files = ", ".join(short_path(f) for f in patch.files)
        sys.stderr.write(f"patch-dsv4: {patch.id} is {patch.shown_verdict}" + (f" ({files})" if files else "") + "\n")
    if report.next_step:
        sys.stderr.write(f"patch-dsv4: run: {report.next_step}\n")


def doctor_lines(report, style: Style) -> list[str]:
    """doctor for people: a row per check (status, id, what was read), the fix under every warn and fail."""
    if style.verbosity < 0:
        return [f"{r.status.upper():<5} {r.id}: {r.fix}" for r in report.rows if r.status == "fail"] + [report.summary]
    head = f"vLLM {report.vllm_version} at {report.target}" + (f"; pack {report.pack}" if report.pack else "; no --pack")
    lines = _wrap(head, style.width, "")
    width = max((len(r.id) for r in report.rows), default=0) + 1
    for row in report.rows:
        status = style.paint(f"{row.status:<5}", {"fail": "drifted", "warn": "pending", "pass": "applied"}.get(row.status, ""))
        prefix = f"  {status} {row.id:<{width}}"
        body = _wrap(row.detail, style.width - 8 - width, "")
        if all(len(line) <= style.width - 8 - width for line in body):
            lines.append(prefix + (body[0] if body else ""))
            lines.extend(" " * (8 + width) + line for line in body[1:])
        else:  # a path longer than the column: the detail starts on a line of its own
            lines.append(prefix.rstrip())
            lines.extend(_wrap_fitting(row.detail, style.width, " " * 10))
        if row.fix and row.status in ("warn", "fail"):
            lines.extend(_wrap_fitting(f"fix: {row.fix}", style.width, " " * 10))
    lines.append(report.summary)
    return lines


def render_doctor(report, fmt: str, verbosity: int = 0) -> None:
    if fmt == "json":
        write_json(report.to_json())
        return
    fixed = report.fixed
    if fixed is not None:
        if fixed.refused:
            sys.stderr.write(f"patch-dsv4: --fix-config wrote nothing: {fixed.refused}\n")
        elif fixed.diff:
            sys.stdout.write(fixed.diff)
            sys.stderr.write(f"patch-dsv4: wrote {fixed.config}; the original is kept as {fixed.backup}\n")
        else:
            sys.stderr.write("patch-dsv4: --fix-config: config.json needs no change\n")
    if fmt == "markdown":
        lines = [f"**patch-dsv4 doctor**: vLLM {report.vllm_version}, pack `{report.pack}`", "",
                 "| check | status | what was read | fix |", "|---|---|---|---|"]
        lines += [f"| `{r.id}` | {r.status} | {_cell(r.detail)} | {_cell(r.fix or '')} |" for r in report.rows]
        sys.stdout.write("\n".join([*lines, "", f"**{report.summary}**", ""]))
        return
    style = Style.for_stream(sys.stdout, verbosity)
    sys.stdout.write("\n".join(doctor_lines(report, style)) + "\n")
