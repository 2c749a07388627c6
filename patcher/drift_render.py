"""The drift report for people (table), machines (json) and pull requests or issues (markdown)."""

from __future__ import annotations

import json
import sys

from patch_dsv4.drift import DriftReport


def _head(d: DriftReport) -> str:
    r = d.report
    fi = r.flashinfer_version or "none"
    if d.flashinfer_given:
        fi += " (--flashinfer-version)"
    elif r.flashinfer_source:
        fi += f" ({r.flashinfer_source})"
    return f"vLLM {r.vllm_version} ({d.release}); FlashInfer {fi}; {'known' if d.build.known else 'unknown'} build"


def _prints(d: DriftReport, patch_id: str, markdown: bool) -> list[str]:
    lines = []
    for a in d.anchors.get(patch_id, ()):
        where = f"{a.file.rsplit('/', 1)[-1]}:{a.scope}"
        fp = a.fingerprint or "-"
        if markdown:
            where, fp = f"`{where}`", f"`{fp}`"
        status = a.status
        if a.recorded_in:
            status += f" ({', '.join(a.recorded_in)})"
        lines.append(f"{where} {fp} {status}")
    return lines


def _problems(d: DriftReport):
    for p in d.report.patches:
        for e in p.edits:
            if e.verdict.value == "drifted":
                yield p.id, e


def render_table(d: DriftReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=max(140, Console().width))
    console.print(_head(d), highlight=False)
    table = Table(show_lines=True)
    for column in ("patch", "verdict", "enclosing functions (fingerprint)", "evidence"):
        table.add_column(column, overflow="fold")
    for p in d.report.patches:
        table.add_row(p.id, p.verdict.value, "\n".join(_prints(d, p.id, False)) or "-", p.detail)
    console.print(table)
    for pid, e in _problems(d):
        console.print(f"{pid}: {e.label}: {e.detail}", highlight=False)
        if e.expected is not None:
            console.print("  expected:\n" + _indent(e.expected), highlight=False)
        if e.found is not None:
            console.print("  found:\n" + _indent(e.found), highlight=False)
    for note in d.report.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(d.report.summary, highlight=False)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(d: DriftReport) -> str:
    lines = [
        f"### patch-dsv4 drift: vLLM {d.report.vllm_version}",
        "",
        _head(d),
        "",
        "| patch | verdict | enclosing functions (fingerprint) | evidence |",
        "|---|---|---|---|",
    ]
    for p in d.report.patches:
        prints = "<br>".join(_cell(x) for x in _prints(d, p.id, True)) or "-"
        lines.append(f"| `{p.id}` | {p.verdict.value} | {prints} | {_cell(p.detail)} |")
    lines.append("")
    for pid, e in _problems(d):
        lines += [f"**{pid}**: {_cell(e.detail)}", ""]
        if e.expected is not None:
            lines += ["expected:", "```python", e.expected.rstrip("\n"), "```"]
        if e.found is not None:
            lines += ["found:", "```python", e.found.rstrip("\n"), "```"]
        lines.append("")
    lines.extend(f"- {_cell(note)}" for note in d.report.notes)
    lines += ["", f"**{d.report.summary}**", ""]
    return "\n".join(lines)


def render(d: DriftReport, fmt: str) -> None:
    if fmt == "json":
        sys.stdout.write(json.dumps(d.to_json(), indent=2) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(d))
    else:
        render_table(d)
