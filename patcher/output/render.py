"""Reports for people (text), machines (json) and pull requests or issues (markdown).

One renderer for every command's report (status, verify, apply, revert and
drift), and one form every view is made from: the report's JSON document, built
here from plain values (:func:`report_document`), with its closing line
(:func:`summary_text`) and the command it advises (:func:`next_command`). The
typed reports of :mod:`patch_dsv4.output.verdicts` build their documents with these
functions, and verify's fast path builds its document with them straight from
the recorded verdicts, without the typed model (importing dataclasses and
building its classes costs about 15 ms): the two paths cannot say different
things, in any format.

Human output: a line per patch that fits the terminal (80 columns included), the
evidence only where it explains something, each sentence once, and a closing
line. Plain text whenever stdout is not a terminal; colour only on a terminal,
and never with ``NO_COLOR``. Nothing here imports rich, libcst, dataclasses or
typing, nor anything of patch-dsv4.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs verify 2 ms
if TYPE_CHECKING:  # the annotations only (postponed): verify imports neither collections.abc nor io for them
    from collections.abc import Callable, Iterable
    from io import TextIOBase as TextIO

PACKAGE_PREFIX = "vllm/models/deepseek_v4/"
V41_PREFIXES = ("vllm/models/deepseek_v41/", "vllm/models/deepseek_v4_1/")
#: The version of the JSON documents every command writes (README, "JSON output"; patcher/report.schema.json).
JSON_SCHEMA = 1
#: Verdicts that fail ``verify``: the environment is not in the state it needs.
NEEDS_ACTION = ("pending", "drifted", "modified", "foreign")
#: Verdicts whose evidence explains something by default (the rest only with -v).
EXPLAINED = ("upstream", "drifted", "modified", "foreign")
_COLOURS = {
    "applied": "32",
    "upstream": "36",
    "pending": "33",
    "drifted": "31",
    "modified": "31",
    "opt-in": "2",
    "foreign": "31",
}


# -- the documents ---------------------------------------------------------------------------
def edit_document(
    label: str,
    file: str,
    scope: str,
    verdict: str,
    detail: str,
    expected: str | None = None,
    found: str | None = None,
    foreign: str | None = None,
) -> dict:
    """One edit's judgement, as every document holds it."""
    return {
        "label": label,
        "file": file,
        "scope": scope,
        "verdict": verdict,
        "detail": detail,
        "expected": expected,
        "found": found,
        "foreign": foreign,
    }


def foreign_scripts(verdict: str, edits: Iterable[str | None]) -> str | None:
    """A foreign patch's scripts (the ``foreign`` of its ``edits``), comma-separated; None for other verdicts."""
    if verdict != "foreign":
        return None
    return ", ".join(dict.fromkeys(script for script in edits if script)) or None


def shown_verdict(verdict: str, foreign: str | None) -> str:
    """The verdict as people read it: a foreign edit names its script (``foreign: <script>``)."""
    return f"foreign: {foreign}" if foreign else verdict


def patch_document(
    patch_id: str, title: str, verdict: str, files: Iterable[str], detail: str, edits: list[dict]
) -> dict:
    """One patch's verdict, files, evidence and edits (``edits``: edit documents)."""
    return {
        "id": patch_id,
        "title": title,
        "verdict": verdict,
        "foreign": foreign_scripts(verdict, (e["foreign"] for e in edits)),
        "files": list(files),
        "detail": detail,
        "edits": edits,
    }


def report_document(
    command: str,
    exit_code: int,
    target: str | None,
    vllm_version: str | None,
    flashinfer_version: str | None,
    flashinfer_source: str | None,
    build: dict | None,
    state: str | None,
    patches: list[dict],
    summary: str,
    changed_files: Iterable[str] = (),
    backups: str | None = None,
    saved_edits: Iterable[str] = (),
    diff: str | None = None,
    notes: Iterable[str] = (),
    next_step: str | None = None,
    fingerprint: str | None = None,
    hooks: Iterable[dict] = (),
) -> dict:
    """The document of status, verify, apply and revert (``patches``: patch documents): the same keys on every path."""
    return {
        "schema": JSON_SCHEMA,
        "command": command,
        "exit_code": exit_code,
        "error": None,
        "target": target,
        "vllm_version": vllm_version,
        "flashinfer_version": flashinfer_version,
        "flashinfer_source": flashinfer_source,
        "build": build,
        "state": state,
        "patches": patches,
        "changed_files": list(changed_files),
        "backups": backups,
        "saved_edits": list(saved_edits),
        "diff": diff,
        "notes": list(notes),
        "next": next_step,
        "fingerprint": fingerprint,
        "hooks": [dict(hook) for hook in hooks],
        "summary": summary,
    }


def summary_text(command: str, verdicts: Iterable[str], extra: str = "") -> str:
    """The closing line of a report: the ``verdicts`` (one a patch) counted, and what was done."""
    counts: dict[str, int] = {}
    for verdict in verdicts:
        counts[verdict] = counts.get(verdict, 0) + 1
    text = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patches"
    return f"{command}: {text}" + (f"; {extra}" if extra else "")


def next_command(target_args: str, verdicts: Iterable[str], foreign_next: str | None = None) -> str | None:
    """The one command that resolves patches with these failing ``verdicts``, naming the target as the user did.

    ``foreign_next`` is the way out of other tools' edits (takeover, or a reinstall where no backup serves).
    """
    verdicts = set(verdicts)
    if not verdicts:
        return None
    if "modified" in verdicts:
        return f"patch-dsv4 revert --discard-local-edits{target_args} (your edit is saved first), then apply"
    if "foreign" in verdicts:
        return foreign_next or f"patch-dsv4 takeover{target_args}"
    if "drifted" in verdicts:
        return f"patch-dsv4 status -v{target_args} (a patch no longer matches this vLLM: do not serve it)"
    return f"patch-dsv4 apply{target_args}"


def _document(report) -> dict:
    """A report's document: ``report`` itself when it is one, else what its ``to_json`` gives."""
    return report if isinstance(report, dict) else report.to_json()


# -- text --------------------------------------------------------------------------------------
class Style:
    """How human output looks on this stream: its width, colour, and how much to say."""

    __slots__ = ("width", "colour", "verbosity")

    def __init__(self, width: int = 80, colour: bool = False, verbosity: int = 0) -> None:
        self.width, self.colour = width, colour
        self.verbosity = verbosity  # -1 quiet (closing line only), 0 normal, 1 verbose

    @classmethod
    def for_stream(cls, stream: TextIO, verbosity: int = 0) -> Style:
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


#: The whitespace textwrap turns into spaces (a line holding one is left to textwrap).
_FOLDED = frozenset("\t\n\x0b\x0c\r")


def short_path(relpath: str) -> str:
    """A file of the DeepSeek-V4 package without the prefix every one of them shares; one of V4.1's
    (``deepseek_v41/``, ``deepseek_v4_1/``) keeps its package's name."""
    if relpath.startswith(PACKAGE_PREFIX):
        return relpath[len(PACKAGE_PREFIX) :]
    if relpath.startswith(V41_PREFIXES):
        return relpath[len("vllm/models/") :]
    return relpath


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """Wrapped at spaces only: a path is never folded."""
    if len(indent) + len(text) <= width and text and not text[-1].isspace() and not _FOLDED.intersection(text):
        return [indent + text]  # what textwrap gives a line that fits, without importing it (1 ms)
    import textwrap

    return textwrap.wrap(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def _wrap_fitting(text: str, width: int, indent: str, fallback: str = "  ") -> list[str]:
    """Wrapped at ``indent``; if a word (a long path) cannot fit there, at the smaller ``fallback`` indent."""
    lines = _wrap(text, width, indent)
    if all(len(line) <= width for line in lines):
        return lines
    return _wrap(text, width, fallback)


def _evidence(patch: dict, verbose: bool) -> list[str]:
    """The sentences that explain a verdict, each once (all of them with -v)."""
    if not verbose and patch["verdict"] not in EXPLAINED:
        return []
    sentences = [e["detail"] for e in patch["edits"] if verbose or e["verdict"] == patch["verdict"]] or [
        patch["detail"]
    ]
    return _merge_shared_reasons(list(dict.fromkeys(_short_paths_in(s) for s in sentences if s)))


def _short_paths_in(sentence: str) -> str:
    """A sentence with every model-package path in the short form :func:`short_path` gives (one that names V4's
    package from ``deepseek_v4/`` on, as some evidence does, too: a file is named one way)."""
    sentence = sentence.replace(PACKAGE_PREFIX, "")
    for prefix in V41_PREFIXES:
        sentence = sentence.replace(prefix, prefix[len("vllm/models/") :])
    key, kept, at = "deepseek_v4/", [], 0
    while (found := sentence.find(key, at)) >= 0:
        starts_a_path = found == 0 or not (sentence[found - 1].isalnum() or sentence[found - 1] in "_./")
        kept.append(sentence[at:found] if starts_a_path else sentence[at : found + len(key)])
        at = found + len(key)
    return "".join(kept) + sentence[at:]


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


def _shown(patch: dict) -> str:
    return shown_verdict(patch["verdict"], patch["foreign"])


def _is_shown_in_full(edit: dict) -> bool:
    """An edit whose expected code (and what stands there) the report shows."""
    return edit["verdict"] in ("drifted", "modified") and edit["expected"] is not None


def text_lines(doc: dict, style: Style, per_patch: Callable[[str], list[str]] | None = None) -> list[str]:
    """A report's document for people, as lines (``per_patch`` adds lines under a patch: drift's fingerprints).

    One line a patch: its id, its verdict and why in a few words; under a drifted, modified or foreign one, a
    line per edit that decides it (where, and what was found). ``-v`` (verbosity 1) gives the files, every
    sentence of evidence and the expected/found code: :func:`verbose_lines`.
    """
    if style.verbosity < 0:
        return _wrap(doc["summary"], style.width, "")
    if style.verbosity > 0:
        return verbose_lines(doc, style, per_patch)
    lines = _head(doc, style)
    patches = doc["patches"]
    id_width = max((len(p["id"]) for p in patches), default=0) + 2
    verdict_width = max((len(p["verdict"]) for p in patches), default=0) + 2
    for patch in patches:
        head = f"  {patch['id']:<{id_width}}"
        verdict = _shown(patch)
        shown = f"{verdict:<{verdict_width}}" if len(verdict) < verdict_width else verdict + "  "
        room = style.width - len(head) - len(shown)
        reason = reason_text(patch)
        if len(reason) > room:  # cut to fit; where the lines under the row explain it, left out
            reason = "" if patch["verdict"] in _NEEDS or room < 16 else fit(reason, room)
        lines.append((head + style.paint(shown, patch["verdict"]) + reason).rstrip())
        lines.extend(deciding_lines(patch, style.width))
        lines.extend("      " + fit(kept, style.width - 6) for kept in kept_edits(patch))
        extras = per_patch(patch["id"]) if per_patch is not None else []
        if extras:  # drift's enclosing functions worth a look, counted by status ("... new"): -v lists them
            counts: dict[str, int] = {}
            for extra in extras:
                status = extra.rsplit(" ", 1)[-1]
                counts[status] = counts.get(status, 0) + 1
            text = ", ".join(f"{n} {status}" for status, n in counts.items())
            lines.append(_edit_line(f"enclosing functions: {text} (-v lists them)", "", style.width))
    build = doc["build"]
    if build is not None and not build["known"]:
        lines.extend(_wrap(build["detail"], style.width, ""))
    if doc["changed_files"] and doc["backups"]:  # the closing line counts the files; -v lists them
        lines.extend(_wrap(f"backups: {doc['backups']}", style.width, ""))
    for saved in doc["saved_edits"]:
        lines.extend(_wrap(f"your edit is saved as {saved}", style.width, ""))
    for note in doc["notes"]:
        if build is None or note != build["detail"]:  # said once, above
            lines.extend(_wrap(f"note: {note}", style.width, ""))
    lines.extend(_wrap(doc["summary"], style.width, ""))
    return lines


def _head(doc: dict, style: Style) -> list[str]:
    """The release judged and where (one line, wrapped only where a path is long), then what kind of build."""
    fi = doc["flashinfer_version"] or "none"
    if doc["flashinfer_source"]:
        fi += f", {doc['flashinfer_source']}"
    release = f"vLLM {doc['vllm_version']} (FlashInfer {fi})"
    if len(release) + 4 + len(doc["target"]) <= style.width:
        lines = [f"{release} at {doc['target']}"]
    else:  # where it is, on a line of its own: "at wheel NAME" is never split
        lines = [release, *_wrap_fitting(f"at {doc['target']}", style.width, "", "")]
    facts = []
    if doc["build"] is not None:
        facts.append("known build" if doc["build"]["known"] else "unknown build")
    if doc["state"] is not None:
        facts.append(f"state: {doc['state']}")
    if facts:
        lines.append("; ".join(facts))
    return lines


def fit(text: str, room: int) -> str:
    """``text`` whole if it fits in ``room`` columns, else cut at a space with ``...`` (the rest is under -v)."""
    if len(text) <= room:
        return text
    cut = text[: max(0, room - 3)]
    if " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:(") + "..."


def _fields(fingerprint: str, room: int) -> str:
    """A fingerprint whole if it fits in ``room`` columns, else cut after a field (``dsv4:1:HEAD:...:...``)."""
    if len(fingerprint) <= room:
        return fingerprint
    cut = fingerprint[: room - 3]
    return cut[: cut.rindex(":") + 1] + "..." if ":" in cut else cut + "..."


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


#: What a verdict that needs action means, in a few words (the edits under it say where).
_NEEDS = {
    "drifted": "needed, but the code no longer matches its anchor",
    "modified": "changed since patch-dsv4 wrote it",
    "foreign": "another tool's edit",
}


#: How a modified edit's evidence says that its file changed elsewhere (patch_dsv4.pipeline.judge.state_reports).
_OUTSIDE = " changed outside our edit ("


def reason_text(patch: dict) -> str:
    """Why a patch has its verdict, in a few words: what ``status`` prints beside it."""
    verdict = patch["verdict"]
    deciding = [e for e in patch["edits"] if e["verdict"] == verdict]
    files = list(dict.fromkeys(e["file"] for e in deciding)) or list(patch["files"])
    if verdict == "opt-in":
        if any(e["foreign"] for e in patch["edits"]):  # -v names the script
            return f"another tool's edit: takeover --with {patch['id']}"
        return f"apply --with {patch['id']} to use it"
    if verdict == "pending":
        return f"needed: {_plural(len(files), 'file')} to patch"
    if verdict == "applied":
        return f"our edit, intact, in {_plural(len(files), 'file')}"
    if verdict == "modified" and deciding and all(_OUTSIDE in e["detail"] for e in deciding):
        return "its file changed, outside our edit"
    if verdict in _NEEDS:
        return _NEEDS[verdict]
    sentences = [_short_paths_in(e["detail"]) for e in deciding if e["detail"]] or [_short_paths_in(patch["detail"])]
    if verdict == "upstream":
        return _fixed_where(list(dict.fromkeys(_where_fixed(s) for s in sentences)))
    return _first_clause(sentences[0])


def _first_clause(sentence: str) -> str:
    """A sentence up to its first ``: ``, without a closing parenthesis that names a file (said under -v)."""
    clause = sentence.split(": ", 1)[0]
    head, sep, last = clause.rpartition(" (")
    return head if sep and last.endswith(")") and ".py" in last else clause


def _where_fixed(sentence: str) -> str:
    """Where an ``upstream`` sentence says the fix is: its file, else its first clause."""
    first = sentence.split(" ", 1)[0].rstrip(":,;")
    if first.endswith(".py"):
        return first
    return sentence.split(": ", 1)[0]


def _fixed_where(places: list[str]) -> str:
    """``fixed in a.py, b.py +2 more``: as many places as a line holds (:func:`fit` cuts the rest)."""
    text = ", ".join(places)
    if places and places[0].endswith(".py"):
        text = "fixed in " + text
    if len(places) > 1 and len(text) > 48:
        shown = "fixed in " + places[0] if places[0].endswith(".py") else places[0]
        return f"{shown} +{len(places) - 1} more"
    return text


def deciding_lines(patch: dict, width: int) -> list[str]:
    """Under a drifted, modified or foreign patch, a line for each file and finding that decides it: the file,
    what was found, and the scopes where it fits (the expected and found code is under -v)."""
    if patch["verdict"] not in _NEEDS:
        return []
    found: dict[tuple[str, str], list[str]] = {}
    for edit in patch["edits"]:
        if edit["verdict"] == patch["verdict"]:
            found.setdefault((short_path(edit["file"]), _what(edit)), []).append(edit["scope"])
    lines = []
    for (file, what), scopes in found.items():
        methods = list(dict.fromkeys(scope.rsplit(".", 1)[-1] for scope in scopes))
        count = f"{len(scopes)}x " if len(scopes) > len(methods) else ""
        tries = [f"{what} ({', '.join(dict.fromkeys(scopes))})", f"{what} ({count}{', '.join(methods)})"]
        room = width - 8 - len(file)
        text = next((t for t in tries if len(t) <= room), None)
        lines.append(f"      {file}: {text}" if text else _edit_line(file, what, width))
    return lines


#: How a drifted edit's detail says why the probe proved no fix (patch_dsv4.patching.edits.NotProven).
NOT_UPSTREAM = "; not upstream: "

#: How an edit's evidence says that another tool's edit, with no equivalent here, stays
# (patch_dsv4.patching.edits.KeptEdit).
_KEPT = "; patch-dsv4 leaves it in place"


def kept_edits(patch: dict) -> list[str]:
    """Other tools' edits in the patch's scopes that stay where they are, one line each: ``<script> (<tool>)
    edited <file>: left in place`` (the scope, and what it means for serving, are under -v)."""
    found = []
    for edit in patch["edits"]:
        if _KEPT not in edit["detail"]:
            continue
        import re  # only where another tool's edit stands (the floor's wrapper has imported it anyway)

        for match in re.finditer(r"(\S+ \([^()]*\)) edited (\S+) \([^()]*\):", edit["detail"]):
            found.append(f"{match[1]} edited {match[2]}: left in place")
    return list(dict.fromkeys(found))


def _what(edit: dict) -> str:
    """An edit's detail without what its line says already: the edit's label, its file and its scope."""
    what = _short_paths_in(edit["detail"])
    if what.startswith(edit["label"] + ": "):
        what = what[len(edit["label"]) + 2 :]
    if edit["foreign"] and what.startswith(edit["foreign"]) and "; " in what:
        return what.split("; ", 1)[1]  # the script is named beside the verdict: what its edit means for serving
    short = short_path(edit["file"])
    what = what.replace(f" in {short} ({edit['scope']})", "")
    if what.startswith(short + " "):
        what = what[len(short) + 1 :]
    what = what.split(" (was ", 1)[0]  # modified: what the edit was is said under -v
    return what.split(NOT_UPSTREAM, 1)[0]  # why it is not upstream (what the evaluator met) is said under -v


def _edit_line(where: str, what: str, width: int) -> str:
    """``      where: what``, on one line: the place whole, what was found cut to fit (all of it under -v)."""
    line = "      " + where
    room = width - len(line) - 2
    if what and room >= 12:
        line += ": " + fit(what, room)
    return line


def verbose_lines(doc: dict, style: Style, per_patch: Callable[[str], list[str]] | None = None) -> list[str]:
    """``-v``: each patch's files, every sentence of its evidence, and the code expected and found where an
    edit drifted or changed; the backups, the fingerprint."""
    lines = _head(doc, style)
    build = doc["build"]
    patches = doc["patches"]
    id_width = max((len(p["id"]) for p in patches), default=0) + 2
    verdict_width = max((len(p["verdict"]) for p in patches), default=0) + 2
    for patch in patches:
        head = f"  {patch['id']:<{id_width}}"
        verdict = _shown(patch)
        files = ", ".join(short_path(f) for f in patch["files"]) or "-"
        room = style.width - len(head) - verdict_width
        if len(files) <= room and len(verdict) < verdict_width:
            lines.append(head + style.paint(f"{verdict:<{verdict_width}}", patch["verdict"]) + files)
        else:
            lines.append(head + style.paint(verdict, patch["verdict"]))
            lines.extend(_wrap(files, style.width, " " * (len(head) + verdict_width)))
        for sentence in _evidence(patch, True):
            lines.extend(_wrap_fitting(sentence, style.width, "      "))
        for extra in per_patch(patch["id"], True) if per_patch is not None else ():
            lines.extend(_wrap_fitting(extra, style.width, "      "))
        for edit in patch["edits"]:
            if _is_shown_in_full(edit):
                import textwrap  # only where code is shown

                lines.extend(_wrap_fitting(f"in {short_path(edit['file'])}:{edit['scope']}", style.width, "      "))
                lines.append("      expected:")
                lines.extend("        " + line for line in textwrap.dedent(edit["expected"]).splitlines())
                if edit["found"] is not None:
                    lines.append("      found:")
                    lines.extend("        " + line for line in textwrap.dedent(edit["found"]).splitlines()[:12])
    if build is not None:
        lines.extend(_wrap(build["detail"], style.width, ""))
    if doc.get("fingerprint"):
        # its head (equal heads, equal trees) and versions, cut at a field: the whole is for copying, on its own
        lines += [
            "fingerprint of what this tree serves (status --fingerprint prints it whole):",
            "  " + _fields(doc["fingerprint"], style.width - 2),
        ]
    if doc["changed_files"]:
        lines.append(f"{'restored' if doc['command'] == 'revert' else 'wrote'} {len(doc['changed_files'])} file(s):")
        lines.extend(f"  {relpath}" for relpath in doc["changed_files"])
    if doc["backups"]:
        lines.extend(_wrap(f"backups: {doc['backups']}", style.width, ""))
    for saved in doc["saved_edits"]:
        lines.extend(_wrap(f"your edit is saved as {saved}", style.width, ""))
    for note in doc["notes"]:
        lines.extend(_wrap(f"note: {note}", style.width, ""))
    lines.extend(_wrap(doc["summary"], style.width, ""))
    return lines


# -- list ------------------------------------------------------------------------------------
def list_lines(patches: list[tuple], style: Style) -> list[str]:
    """``list``: a line per patch (``patches``: (id, opt_in, title, why, files) each): its id, whether it is an
    opt-in, its title (cut to the width: ``list ID`` says it all), then a closing line."""
    id_width = max((len(p[0]) for p in patches), default=0) + 2
    lines = []
    for pid, opt_in, title, _why, _files in patches:
        head = f"{pid:<{id_width}}{'opt-in' if opt_in else 'default':<9}"
        lines.append(head + fit(_title(title, opt_in), style.width - len(head)))
    opt_ins = sum(1 for p in patches if p[1])
    lines.extend(
        _wrap(
            f"list: {len(patches)} patches, {opt_ins} opt-in; what each fixes and why: patch-dsv4 list ID (or -v)",
            style.width,
            "",
        )
    )
    return lines


def _title(title: str, opt_in: bool) -> str:
    """A title without the ``opt-in:`` its column says already."""
    return title[len("opt-in: ") :] if opt_in and title.startswith("opt-in: ") else title


def why_lines(patches: list[tuple], style: Style) -> list[str]:
    """``list -v`` or ``list ID``: each patch's id and title, then its prose (the module's docstring) wrapped to
    the width, its files, and how to use it if it is an opt-in."""
    lines: list[str] = []
    for pid, opt_in, title, why, files in patches:
        if lines:
            lines.append("")
        lines.extend(_wrap(f"{pid}: {_title(title, opt_in)}" + (" (opt-in)" if opt_in else ""), style.width, ""))
        for paragraph in _paragraphs(why):
            lines.append("")
            bullet = paragraph.startswith("- ")
            body = paragraph[2:] if bullet else paragraph
            wrapped = _wrap(body, style.width - 4 - (2 if bullet else 0), "")
            lines.extend(
                ("    - " if bullet and i == 0 else "      " if bullet else "    ") + line
                for i, line in enumerate(wrapped)
            )
        lines.append("")
        lines.extend(_wrap_fitting(f"files: {', '.join(short_path(f) for f in files)}", style.width, "    "))
        if opt_in:
            lines.extend(_wrap(f"use it: patch-dsv4 apply --with {pid}", style.width, "    "))
    return lines


def _paragraphs(text: str) -> list[str]:
    """Prose as paragraphs and list items, each one line (a ``- `` item is a paragraph of its own)."""
    found: list[str] = []
    current: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("- "):
            if current:
                found.append(" ".join(current))
            current = [line] if line else []
        else:
            current.append(line)
    if current:
        found.append(" ".join(current))
    return found


# -- markdown ----------------------------------------------------------------------------------
def markdown(doc: dict, extra_head: str = "", extra_columns: dict[str, str] | None = None) -> str:
    """A report's document as markdown: a row a patch (its verdict and why), where a drifted, modified or
    foreign one stands, then every patch's files and evidence and the expected/found code in a collapsed
    section, the notes and the summary."""
    extra_columns = extra_columns or {}
    head = f"**patch-dsv4 {doc['command']}**: vLLM {doc['vllm_version']}"
    head += f", FlashInfer {doc['flashinfer_version'] or 'none'}" + (
        f" ({doc['flashinfer_source']})" if doc["flashinfer_source"] else ""
    )
    if doc["build"] is not None:
        head += f"; {'known' if doc['build']['known'] else 'unknown'} build"
    columns = ["patch", "verdict", "why", *([extra_head] if extra_head else [])]
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for p in doc["patches"]:
        cells = [f"`{p['id']}`", _shown(p), _cell(reason_text(p))]
        if extra_head:
            cells.append(extra_columns.get(p["id"], "-"))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for p in doc["patches"]:
        for line in deciding_lines(p, 1 << 16):
            lines.append(f"- **{p['id']}**: `{_cell(line.strip()).replace(': ', '`: ', 1)}")
    if any(deciding_lines(p, 1) for p in doc["patches"]):
        lines.append("")
    lines += ["<details><summary>files and evidence</summary>", ""]
    for p in doc["patches"]:
        files = ", ".join(f"`{short_path(f)}`" for f in p["files"]) or "-"
        evidence = " ".join(dict.fromkeys(e["detail"] for e in p["edits"])) or p["detail"]
        lines.append(f"- **{p['id']}** ({_shown(p)}; {files}): {_cell(evidence)}")
    lines.append("")
    for p in doc["patches"]:
        for e in p["edits"]:
            if _is_shown_in_full(e):
                lines += [
                    f"**{p['id']}**: {_cell(e['detail'])}",
                    "",
                    "expected:",
                    "```python",
                    e["expected"].rstrip("\n"),
                    "```",
                ]
                if e["found"] is not None:
                    lines += ["found:", "```python", e["found"].rstrip("\n"), "```"]
                lines.append("")
    lines += ["</details>", ""]
    lines.extend(f"- {_cell(note)}" for note in doc["notes"])
    if doc["diff"]:
        lines += ["", "```diff", doc["diff"].rstrip("\n"), "```"]
    lines += ["", f"**{doc['summary']}**", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- writing -----------------------------------------------------------------------------------
def write_json(document: dict, stream: TextIO | None = None) -> None:
    import json  # here, not at the top: verify's fast path writes no JSON unless asked for it (json costs 1-2 ms)

    (stream or sys.stdout).write(json.dumps(document, indent=2) + "\n")


def render(document, fmt: str, verbosity: int = 0) -> None:
    """Write a report to stdout in ``fmt``; an apply --dry-run's diff is stdout's only content.

    ``document``: a report's document, or any report with ``to_json`` (a typed report, a drift report,
    whose ``markdown_column`` and ``fingerprint_lines`` add drift's own cells and lines).
    """
    doc = _document(document)
    if fmt == "json":
        write_json(doc)
        return
    stream = sys.stdout
    if doc["diff"] is not None and fmt == "table":
        # stdout holds the patch alone (`apply --dry-run > fix.patch`); the report goes to stderr
        sys.stdout.buffer.write(doc["diff"].encode("utf-8", "surrogateescape")) if hasattr(sys.stdout, "buffer") else (
            sys.stdout.write(doc["diff"])
        )
        sys.stdout.flush()
        stream = sys.stderr
    if fmt == "markdown":
        stream.write(markdown(doc, *getattr(document, "markdown_column", lambda: ("", None))()))
        return
    style = Style.for_stream(stream, verbosity)
    stream.write("\n".join(text_lines(doc, style, getattr(document, "fingerprint_lines", None))) + "\n")


#: Where a message's part continues on the next line (README, "Errors").
CONTINUED = "patch-dsv4:   "
#: The longest word a message keeps whole (a path, a command); a longer one (a value pasted by mistake) is cut.
_LONGEST = 160


def message_lines(parts: Iterable[tuple[str, str]], width: int = 80) -> list[str]:
    """A message for people on stderr, the one layout of every error and refusal: each part on lines of its own,
    led by ``patch-dsv4: <label>:`` (``error``, ``why``, ``next``), folded at spaces to ``width`` onto lines led by
    :data:`CONTINUED` (a flag or a path is never folded: a word longer than a line stands whole)."""
    import textwrap

    lines: list[str] = []
    for label, text in parts:
        if text:
            words = [w[i : i + _LONGEST] for w in text.split() for i in range(0, len(w), _LONGEST)]
            lines += textwrap.wrap(
                " ".join(words),
                width,
                initial_indent=f"patch-dsv4: {label}: " if label else "patch-dsv4: ",
                subsequent_indent=CONTINUED,
                break_long_words=False,
                break_on_hyphens=False,
            )
    return lines


def error_text(what: str, why: str = "", next_step: str = "", width: int = 80) -> str:
    """An expected error: what failed, why, and the command to run next (:func:`message_lines`)."""
    return "\n".join(message_lines((("error", what), ("why", why), ("next", next_step)), width)) + "\n"


def stderr_width() -> int:
    """The width of stderr's lines: 80 columns, fewer on a narrower terminal."""
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return max(40, min(80, _terminal_width(sys.stderr))) if tty else 80


def say(text: str, label: str = "") -> None:
    """A line for a person on stderr (progress, a note beside the report), in the layout of :func:`message_lines`."""
    sys.stderr.write("\n".join(message_lines(((label, text),), stderr_width())) + "\n")
    sys.stderr.flush()


def write_failure(report) -> None:
    """On stderr, which patches failed and the command that resolves them (verify's and drift's exit 1), in the
    layout of every error (:func:`message_lines`).

    ``report``: a report's document, or a report with ``to_json``.
    """
    doc = _document(report)
    bad = [p for p in doc["patches"] if p["verdict"] in NEEDS_ACTION]
    if not bad and not doc["next"]:
        return
    parts = []
    for patch in bad:
        deciding = [e["file"] for e in patch["edits"] if e["verdict"] == patch["verdict"]] or patch["files"]
        files = [short_path(f) for f in dict.fromkeys(deciding)]
        where = f" in {files[0]}" + (f" and {_plural(len(files) - 1, 'more file')}" if len(files) > 1 else "")
        parts.append(("error", f"{patch['id']} is {_shown(patch)}" + (where if files else "")))
    if doc["next"]:
        parts.append(("next", doc["next"]))
    sys.stderr.write("\n".join(message_lines(parts, stderr_width())) + "\n")


def doctor_lines(report, style: Style) -> list[str]:
    """doctor for people: a row per check (status, id, what was read), the fix under every warn and fail."""
    if style.verbosity < 0:  # the fails and their fixes, each wrapped at spaces under its first line
        import textwrap

        lines = []
        for row in report.rows:
            if row.status == "fail":
                text = f"{row.status.upper():<5} {row.id}: {row.fix}"
                lines += textwrap.wrap(
                    text, style.width, subsequent_indent=" " * 6, break_long_words=False, break_on_hyphens=False
                )
        return [*lines, *_wrap(report.summary, style.width, "")]
    head = f"vLLM {report.vllm_version} at {report.target}" + (
        f"; pack {report.pack}" if report.pack else "; no --pack"
    )
    lines = _wrap(head, style.width, "")
    width = max((len(r.id) for r in report.rows), default=0) + 1
    for row in report.rows:
        status = style.paint(
            f"{row.status:<5}", {"fail": "drifted", "warn": "pending", "pass": "applied"}.get(row.status, "")
        )
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
            say(f"--fix-config wrote nothing: {fixed.refused}")
        elif fixed.diff and not getattr(fixed, "written", True):
            sys.stdout.write(fixed.diff)
            say(
                f"--fix-config wrote nothing: {report.pack} is on the Hub; make these edits in the downloaded pack "
                "(or run doctor --fix-config on its directory)"
            )
        elif fixed.diff:
            sys.stdout.write(fixed.diff)
            say(f"wrote {fixed.config}; the original is kept as {fixed.backup}")
        else:
            say("--fix-config: config.json needs no change")
    if fmt == "markdown":
        lines = [
            f"**patch-dsv4 doctor**: vLLM {report.vllm_version}, pack `{report.pack}`",
            "",
            "| check | status | what was read | fix |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{r.id}` | {r.status} | {_cell(r.detail)} | {_cell(r.fix or '')} |" for r in report.rows]
        sys.stdout.write("\n".join([*lines, "", f"**{report.summary}**", ""]))
        return
    style = Style.for_stream(sys.stdout, verbosity)
    sys.stdout.write("\n".join(doctor_lines(report, style)) + "\n")
