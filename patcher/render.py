"""Reports for people (table), machines (json) and pull requests (markdown)."""

from __future__ import annotations

import json
import sys

from patch_dsv4.verdicts import Report

FORMATS = ("table", "json", "markdown")


def _head(report: Report) -> str:
    fi = report.flashinfer_version or "none"
    if report.flashinfer_source:
        fi += f" ({report.flashinfer_source})"
    head = f"vLLM {report.vllm_version} at {report.target}; FlashInfer {fi}; state: {report.state}"
    if report.build is not None:
        head += f"\n{report.build['detail']}"
    return head


def render_table(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=max(120, Console().width))
    console.print(_head(report), highlight=False)
    table = Table(show_lines=False)
    for column in ("patch", "verdict", "files", "detail"):
        table.add_column(column, overflow="fold")
    for p in report.patches:
        table.add_row(p.id, p.verdict.value, "\n".join(p.files), p.detail)
    console.print(table)
    for p in report.patches:
        for e in p.edits:
            if e.expected is not None and e.verdict.value in ("drifted", "modified"):
                console.print(f"{p.id}: {e.label}\n  expected:\n{_indent(e.expected)}", highlight=False)
                if e.found is not None:
                    console.print(f"  found:\n{_indent(e.found)}", highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)
    if report.diff:
        sys.stdout.write(report.diff)
    console.print(report.summary, highlight=False)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def render_markdown(report: Report) -> str:
    lines = [f"**patch-dsv4 {report.command}**: {_head(report)}", "", "| patch | verdict | files | detail |", "|---|---|---|---|"]
    for p in report.patches:
        detail = p.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{p.id}` | {p.verdict.value} | {'<br>'.join(p.files)} | {detail} |")
    lines.append("")
    lines.extend(f"- {note}" for note in report.notes)
    if report.diff:
        lines += ["", "```diff", report.diff.rstrip("\n"), "```"]
    lines += ["", report.summary, ""]
    return "\n".join(lines)


def render(report: Report, fmt: str) -> None:
    if fmt == "json":
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(report))
    else:
        render_table(report)
