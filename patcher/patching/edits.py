"""ReplaceStatements: the edit every patch is made of.

Matching is done on ``ast`` fingerprints (formatting-blind, exact in
structure), scoped to one class and function of one file; only a pending edit
pays for libcst, which rewrites the matched statements and keeps every other
byte of the file as it was. Releases whose code differs get one
(anchor, replacement) :class:`Variant` each; the engine takes the one that
matches. Helpers are real functions of the patch module: their source, taken
from that module, is inserted at module level of the target file.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from patch_dsv4.output.render import NOT_UPSTREAM
from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patching.fingerprint import find_scope, normalize_node, statements
from patch_dsv4.patching.patch import INJECTED_PREFIX, Context, Edit, Scope


@dataclass(frozen=True)
class NotProven:
    """A probe's answer when it looked for the fix and found no proof: ``why`` names the defect it found or the
    unknown that stopped it ("unknown: <construct> at <file:function:line>"). The anchors decide the verdict, and
    a drifted one says why it is not upstream."""

    why: str


def encode_answer(answer: Outcome | NotProven | None) -> dict:
    """A probe's answer as a release's record keeps it."""
    if answer is None:
        return {"kind": "none"}
    if isinstance(answer, NotProven):
        return {"kind": "not-proven", "why": answer.why}
    fields = ("detail", "variant", "expected", "found", "foreign")
    return {"kind": "outcome", "verdict": answer.verdict.value, **{f: getattr(answer, f) for f in fields}}


def decode_answer(data: dict) -> Outcome | NotProven | None:
    if data["kind"] == "none":
        return None
    if data["kind"] == "not-proven":
        return NotProven(data["why"])
    fields = ("detail", "variant", "expected", "found", "foreign")
    return Outcome(Verdict(data["verdict"]), **{f: data[f] for f in fields})


#: probe(ctx, tree) -> an UPSTREAM / NOT_APPLICABLE (or DRIFTED) answer, NotProven (the anchors decide, and a
#: drifted verdict says why), or None to let the anchors decide.
#: ``tree`` is the edit's file as it is now (None when the file is absent).
Probe = Callable[[Context, "ast.Module | None"], "Outcome | NotProven | None"]


def indent(code: str, spaces: int) -> str:
    """``code`` (dedented, stripped of blank edge lines) indented by ``spaces``, ending with a newline."""
    lines = textwrap.dedent(code).strip("\n").splitlines()
    return "".join((" " * spaces + line if line.strip() else "") + "\n" for line in lines)


@dataclass(frozen=True)
class Variant:
    """One release's form of an edit: the statements it replaces, and what replaces them."""

    anchor: str
    replacement: str
    releases: str = ""  # which releases ship this anchor, for people reading the patch


@functools.cache
def helper_source(function: Callable) -> str:
    """The source of a module-level helper function, exactly as its module has it (decorators excluded)."""
    module_source = inspect.getsource(inspect.getmodule(function))
    for node in ast.parse(module_source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function.__name__:
            lines = module_source.splitlines(keepends=True)
            return "".join(lines[node.lineno - 1 : node.end_lineno])
    raise ValueError(f"{function.__name__} is not a module-level function of {function.__module__}")


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list (body, else, finally, handlers...) under ``node``; found once per node (the parsed
    trees are shared and never changed, so the list is kept on the node)."""
    found = getattr(node, "_patch_dsv4_blocks", None)
    if found is None:
        found = []
        for sub in ast.walk(node):
            for name in ("body", "orelse", "finalbody"):
                block = getattr(sub, name, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    found.append(block)
        node._patch_dsv4_blocks = found  # type: ignore[attr-defined]
    return found


def find_sequences(scope: ast.AST, wanted: list[str]) -> list[tuple[list[ast.stmt], int]]:
    """Where the statements ``wanted`` (canonical forms) stand consecutively in one block of ``scope``."""
    hits = []
    n = len(wanted)
    for block in _blocks(scope):
        if len(block) < n:
            continue
        dumps = [normalize_node(s) for s in block]
        for i in range(len(block) - n + 1):
            if dumps[i : i + n] == wanted:
                hits.append((block, i))
    return hits


def _defined_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    return None


def _named(node: ast.AST) -> list[str]:
    """The injected names ``node`` mentions, in walk order; found once per node (kept on it, as ``_blocks``)."""
    found = getattr(node, "_patch_dsv4_named", None)
    if found is None:
        found = []
        for sub in ast.walk(node):
            name = getattr(sub, "id", None) or getattr(sub, "name", None) or getattr(sub, "attr", None)
            if isinstance(name, str) and name.startswith(INJECTED_PREFIX):
                found.append(name)
        node._patch_dsv4_named = found  # type: ignore[attr-defined]
    return found


def mentions_injected(node: ast.AST, names: frozenset[str] | None = None) -> bool:
    """Whether ``node`` names anything with the injected prefix (a name, a def, an attribute).

    With ``names``, only those count: an edit asks about its own, so that a sibling's edit in the same scope (of
    another patch, or another edit of its own) does not make it look present.
    """
    return any(names is None or name in names for name in _named(node))


@functools.lru_cache(maxsize=256)
def injected_names(*codes: str) -> frozenset[str]:
    """The injected (``_patch_dsv4_*``) names the snippets ``codes`` mention."""
    return frozenset(name for code in codes for name in _named(ast.parse(textwrap.dedent(code))))


@dataclass(frozen=True)
class ForeignEdit:
    """Another tool's edit of the same fix, recognised by facts written here: the names it injects, the shape
    of its statements. Nothing of the other tool's code is kept.

    ``found(tree, scope)`` gets the parsed file and the edit's scope in it (None
    when absent) and returns the evidence (what was seen, where) or None.
    ``meaning`` says what the edit means for serving.
    """

    script: str
    recipe: str
    meaning: str
    found: Callable[[ast.Module, ast.AST | None], str | None] = field(compare=False)

    def outcome(self, label: str, where: str, evidence: str) -> Outcome:
        return Outcome(
            Verdict.FOREIGN,
            f"{label}: {self.script} ({self.recipe}) edited {where}: {evidence}; {self.meaning}",
            foreign=self.script,
        )


@dataclass(frozen=True)
class KeptEdit:
    """Another tool's edit that patch-dsv4 has no equivalent for, in a scope a patch's probes read: never removed
    by patch-dsv4. The patch keeps the verdict its own code earns, with a note naming the script; ``takeover``
    leaves the edit in place and says so. Recognised by facts written here, as :class:`ForeignEdit` is.

    ``found(tree, scope)`` gets the parsed ``file`` and ``scope`` in it (None when absent) and returns the
    evidence or None; ``meaning`` says what the edit means for serving.
    """

    script: str
    recipe: str
    file: str
    scope: Scope
    meaning: str
    found: Callable[[ast.Module, ast.AST | None], str | None] = field(compare=False)

    def note(self, ctx: Context) -> tuple[str, str] | None:
        """(who edited which file, the note for a report) when the edit stands in the target, else None.

        Looks nothing up that could fail a verdict: an absent scope is no evidence either way.
        """
        tree = ctx.ast(self.file)
        evidence = self.found(tree, find_scope(tree, self.scope.cls, self.scope.func)) if tree is not None else None
        if not evidence:
            return None
        where = f"{self.file.rsplit('/', 1)[-1]} ({self.scope})"
        return (
            f"{self.file}: {self.script} ({self.recipe})",
            f"{self.script} ({self.recipe}) edited {where}: {evidence}; {self.meaning}; patch-dsv4 leaves it in place",
        )


@dataclass(frozen=True)
class ReplaceStatements(Edit):
    """Replace the consecutive statements of a variant's ``anchor`` inside ``scope`` by its ``replacement``.

    ``helpers`` are module-level functions of the patch module (named
    ``_patch_dsv4_*``), inserted just before the scope's class (or function).
    ``probe`` runs first and may answer UPSTREAM or NOT_APPLICABLE with
    evidence; when it answers None, the anchors decide between APPLIED,
    PENDING and DRIFTED. With several variants, the one whose replacement is in
    place, else the one whose anchor matches, is the release's; none matching
    is drift reported against the first. ``foreign`` recognise other tools'
    edits of the same fix; they are looked for before anything else, so such an
    edit is never taken for upstream's fix, a pending anchor or ours. ``kept``
    are other tools' edits the probes may read that patch-dsv4 leaves in place:
    the verdict stays the edit's own, with a note naming each one found.
    """

    label: str
    file: str
    scope: Scope
    variants: tuple[Variant, ...]
    helpers: tuple[Callable, ...] = ()
    probe: Probe | None = field(default=None, compare=False)
    foreign: tuple[ForeignEdit, ...] = ()
    kept: tuple[KeptEdit, ...] = ()
    # whether the probe's answer is a function of the files it reads alone (wide-swa's also reads FlashInfer's):
    # then a release's record may answer for it where those files are the release's, byte for byte
    recallable: bool = True

    @property
    def key(self) -> str:
        """The edit, as a release's record names its probe's answer."""
        return f"{self.file}::{self.scope}::{self.label}"

    def helper_sources(self) -> tuple[str, ...]:
        return tuple(helper_source(h) for h in self.helpers)

    def own_names(self) -> frozenset[str]:
        """The injected names this edit writes into its scope (its replacements'). Edits sharing a scope have
        disjoint ones (checked at discovery), so each tells its own statements from a sibling's."""
        return injected_names(*(variant.replacement for variant in self.variants))

    def injected_code(self, outcome: Outcome) -> Sequence[str]:
        return (self.variants[outcome.variant or 0].replacement, *self.helper_sources())

    # -- judging ---------------------------------------------------------------
    def evaluate(self, ctx: Context, text: str | None) -> Outcome:
        outcome = self._evaluate(ctx, text)
        notes = [note for other in self.kept if (note := other.note(ctx))] if text is not None else []
        if notes:
            detail = "; ".join((outcome.detail, *(text for _, text in notes)))
            return replace(outcome, detail=detail, kept=tuple(who for who, _ in notes))
        return outcome

    def _evaluate(self, ctx: Context, text: str | None) -> Outcome:
        tree = None
        if text is not None:
            try:
                tree = ctx.parse(text)
            except SyntaxError as exc:
                return Outcome.drifted(f"{self.file} does not parse: {exc.msg} (line {exc.lineno})")
        where = f"{self.file} ({self.scope})"
        scope = find_scope(tree, self.scope.cls, self.scope.func) if tree is not None else None
        if tree is not None:
            ctx.looked_up(self.file, str(self.scope), scope is not None)
            for other in self.foreign:
                evidence = other.found(tree, scope)
                if evidence:
                    return other.outcome(self.label, where, evidence)
        why = None
        if self.probe is not None:
            answer = self._probe(ctx, tree, text)
            if isinstance(answer, NotProven):
                why = answer.why
            elif answer is not None:
                return answer
        outcome = self._by_anchors(tree, scope, where)
        if why and outcome.verdict is Verdict.DRIFTED:
            return replace(outcome, detail=f"{outcome.detail}{NOT_UPSTREAM}{why}")
        return outcome

    def _probe(self, ctx: Context, tree: ast.Module | None, text: str | None) -> Outcome | NotProven | None:
        """The probe's answer: recalled from the release's record where the files it read are the release's (and
        the text judged is the file's own, not a plan's), else computed (and logged where a record is made)."""
        if self.recallable and text == ctx.read(self.file):
            recalled, answer = ctx.recall(self.key)
            if recalled:
                return decode_answer(answer)  # type: ignore[arg-type]
        with ctx.recording() as reads:
            answer = self.probe(ctx, tree)  # type: ignore[misc]
        if ctx.probe_log is not None and self.recallable and text == ctx.read(self.file):  # not a plan's
            ctx.probe_log.setdefault(self.key, (frozenset(reads | {self.file}), answer))  # its input: the file
        return answer

    def _by_anchors(self, tree: ast.Module | None, scope: ast.AST | None, where: str) -> Outcome:
        """APPLIED, PENDING or DRIFTED from the variants' anchors and replacements in ``scope``."""
        if tree is None:
            return Outcome.not_applicable(f"{self.file} is not part of this release")
        if scope is None:
            return Outcome.drifted(
                f"{self.scope} not found in {self.file}", expected=f"def {self.scope}", found="(absent)"
            )
        helpers_ok, helper_problem = self._helpers_state(tree)
        for index, variant in enumerate(self.variants):
            ours = find_sequences(scope, statements(variant.replacement))
            if len(ours) == 1 and helpers_ok:
                return Outcome(Verdict.APPLIED, f"{self.label}: in place in {where}", variant=index)
            if ours:
                break
        else:
            ours = []
        if ours or helper_problem or mentions_injected(scope, self.own_names()):
            return Outcome.drifted(
                f"{self.label}: our edit in {where} is present but not as we write it"
                + (f" ({helper_problem})" if helper_problem else ""),
                expected=textwrap.dedent(self.variants[0].replacement).strip(),
            )
        for index, variant in enumerate(self.variants):
            anchors = find_sequences(scope, statements(variant.anchor))
            if len(anchors) == 1:
                return Outcome(Verdict.PENDING, f"{self.label}: anchor matches in {where}", variant=index)
            if len(anchors) > 1:
                return Outcome.drifted(
                    f"{self.label}: anchor matches {len(anchors)} times in {where}, expected once",
                    expected=textwrap.dedent(variant.anchor).strip(),
                )
        expected = textwrap.dedent(self.variants[0].anchor).strip()
        return Outcome.drifted(
            f"{self.label}: anchor not found in {where}", expected=expected, found=self._closest(scope, expected)
        )

    def _helpers_state(self, tree: ast.Module) -> tuple[bool, str | None]:
        """(all helpers in place, description of a helper present but changed)."""
        top = {_defined_name(n): n for n in tree.body}
        all_ok = True
        for source in self.helper_sources():
            (node,) = _parse_snippet(source).body
            present = top.get(node.name)
            if present is None:
                all_ok = False
            elif normalize_node(present) != normalize_node(node):
                return False, f"{node.name} differs from what we write"
        return all_ok, None

    @staticmethod
    def _closest(scope: ast.AST, expected: str) -> str:
        want = ast.unparse(ast.parse(expected))
        best, best_ratio = "(nothing similar)", 0.0
        for node in ast.walk(scope):
            if isinstance(node, ast.stmt) and node is not scope:
                text = ast.unparse(node)
                if len(text) > 4 * len(want) + 200:
                    continue
                ratio = difflib.SequenceMatcher(None, want, text).ratio()
                if ratio > best_ratio:
                    best, best_ratio = text, ratio
        return best

    # -- rewriting (libcst only from here) -------------------------------------
    def rewrite(self, module, outcome: Outcome):
        import libcst as cst

        variant = self.variants[outcome.variant or 0]
        newline = module.default_newline
        anchor = statements(variant.anchor)
        parsed = _parse_cst(variant.replacement, newline)
        replacement = list(parsed.body)
        replacement_forms = statements(variant.replacement)
        # libcst files comment lines above the first statement under the module header.
        comments = [line for line in parsed.header if line.comment is not None]
        first_kind = type(ast.parse(textwrap.dedent(variant.anchor)).body[0]).__name__

        def matches(statements_: list) -> bool:
            return [statements(module.code_for_node(s))[0] for s in statements_] == anchor

        def replace(matched: list) -> list:
            """The replacement, keeping vLLM's own statements (formatting, comments) where it repeats them."""
            new, j = [], 0
            kept = len(replacement) == len(replacement_forms)
            for node, form in zip(replacement, replacement_forms if kept else [None] * len(replacement), strict=True):
                if j < len(matched) and form == anchor[j]:
                    new.append(matched[j])
                    j += 1
                else:
                    new.append(node)
            if new[0] is matched[0]:
                new[0] = new[0].with_changes(leading_lines=[*new[0].leading_lines, *comments])
            else:
                new[0] = new[0].with_changes(
                    leading_lines=[*matched[0].leading_lines, *comments, *new[0].leading_lines]
                )
                for k in range(1, len(new)):
                    if new[k] is matched[0]:  # vLLM's comment above it now stands above our statement, once
                        kept = [line for line in matched[0].leading_lines if line.comment is None]
                        new[k] = matched[0].with_changes(leading_lines=kept)
            return new

        class Replace(cst.CSTTransformer):
            done = 0

            def leave_IndentedBlock(self, original, updated):  # noqa: N802 (libcst API)
                body = list(updated.body)
                n = len(anchor)
                for i in range(len(body) - n + 1):
                    if _cst_kind(body[i]) == first_kind and matches(body[i : i + n]):
                        body[i : i + n] = replace(body[i : i + n])
                        Replace.done += 1
                        return updated.with_changes(body=body)
                return updated

        body = list(module.body)
        index = _cst_index(body, self.scope.cls or self.scope.func)
        if self.scope.cls and self.scope.func:
            cls_node = body[index]
            members = list(cls_node.body.body)
            m_index = _cst_index(members, self.scope.func)
            members[m_index] = members[m_index].visit(Replace())
            body[index] = cls_node.with_changes(body=cls_node.body.with_changes(body=members))
        else:
            body[index] = body[index].visit(Replace())
        if Replace.done != 1:
            raise AssertionError(f"libcst found the anchor {Replace.done} times in {self.scope}, ast once")
        present = {_cst_name(s) for s in body}
        blank = cst.EmptyLine(indent=False, whitespace=cst.SimpleWhitespace(""), comment=None)
        new_helpers = []
        for source in self.helper_sources():
            (stmt,) = _parse_cst(source, newline).body
            if _cst_name(stmt) in present:
                continue
            new_helpers.append(stmt.with_changes(leading_lines=[blank, blank, *stmt.leading_lines]))
        if new_helpers and index == 0:
            # at the top of the file: no blank lines above the first helper, two between it and the scope
            new_helpers[0] = new_helpers[0].with_changes(leading_lines=new_helpers[0].leading_lines[2:])
            body[0] = body[0].with_changes(leading_lines=[blank, blank, *body[0].leading_lines])
        body[index:index] = new_helpers
        return module.with_changes(body=body)


@functools.lru_cache(maxsize=256)
def _parse_snippet(source: str) -> ast.Module:
    return ast.parse(textwrap.dedent(source))


@functools.lru_cache(maxsize=256)
def _parse_cst(source: str, newline: str):
    """A snippet as libcst parses it, written with the target file's newlines.

    Multi-line strings keep their newlines verbatim, so the snippet takes the
    file's convention before it is parsed.
    """
    import libcst as cst

    return cst.parse_module(textwrap.dedent(source).replace("\n", newline))


def _cst_kind(stmt) -> str:
    """The ast class name a libcst statement corresponds to (small statements: the first one's)."""
    import libcst as cst

    if isinstance(stmt, cst.SimpleStatementLine) and stmt.body:
        return type(stmt.body[0]).__name__
    return type(stmt).__name__


def _cst_name(stmt) -> str | None:
    """The name a module-level def or class defines."""
    import libcst as cst

    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    return None


def _cst_index(body, name: str) -> int:
    import libcst as cst

    return next(
        i for i, s in enumerate(body) if isinstance(s, (cst.ClassDef, cst.FunctionDef)) and s.name.value == name
    )
