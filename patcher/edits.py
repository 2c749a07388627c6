"""ReplaceStatements: the edit every patch so far is made of.

Matching is done on ``ast`` fingerprints (formatting-blind, exact in
structure), scoped to one class and function of one file; only a pending edit
pays for libcst, which rewrites the matched statements and keeps every other
byte of the file as it was.
"""

from __future__ import annotations

import ast
import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from patch_dsv4.fingerprint import find_scope, normalize_node, statements
from patch_dsv4.patch import Context, Edit, injected_names_prefix
from patch_dsv4.verdicts import Outcome, Verdict

Probe = Callable[[Context, "str | None"], "Outcome | None"]


@dataclass(frozen=True)
class Scope:
    cls: str | None
    func: str | None

    def __str__(self) -> str:
        return ".".join(p for p in (self.cls, self.func) if p) or "<module>"


def _blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every statement list (body, else, finally, handlers...) under ``node``."""
    for sub in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(sub, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _find_sequences(scope: ast.AST, wanted: list[str]) -> list[tuple[list[ast.stmt], int]]:
    hits = []
    n = len(wanted)
    for block in _blocks(scope):
        dumps = [normalize_node(s) for s in block]
        for i in range(len(block) - n + 1):
            if dumps[i : i + n] == wanted:
                hits.append((block, i))
    return hits


def _defined_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _mentions_marker(node: ast.AST) -> bool:
    prefix = injected_names_prefix()
    for sub in ast.walk(node):
        name = getattr(sub, "id", None) or getattr(sub, "name", None) or getattr(sub, "attr", None)
        if isinstance(name, str) and name.startswith(prefix):
            return True
    return False


@dataclass(frozen=True)
class ReplaceStatements(Edit):
    """Replace the consecutive statements ``anchor`` inside ``scope`` by ``replacement``.

    ``helpers`` are module-level definitions (named ``_patch_dsv4_*``) inserted
    just before the scope's class (or function). ``probe`` runs first and may
    answer UPSTREAM or NOT_APPLICABLE with evidence; when it answers None, the
    anchors decide between APPLIED, PENDING and DRIFTED.
    """

    label: str
    file: str
    scope: Scope
    anchor: str
    replacement: str
    helpers: tuple[str, ...] = ()
    probe: Probe | None = field(default=None, compare=False)

    def injected_code(self) -> Sequence[str]:
        return (self.replacement, *self.helpers)

    # -- judging ---------------------------------------------------------------
    def evaluate(self, ctx: Context, text: str | None) -> Outcome:
        if self.probe is not None:
            answer = self.probe(ctx, text)
            if answer is not None:
                return answer
        if text is None:
            return Outcome.not_applicable(f"{self.file} is not part of this release")
        try:
            tree = ctx.parse(text)
        except SyntaxError as exc:
            return Outcome.drifted(f"{self.file} does not parse: {exc.msg} (line {exc.lineno})")
        scope = find_scope(tree, self.scope.cls, self.scope.func)
        if scope is None:
            return Outcome.drifted(
                f"{self.scope} not found in {self.file}", expected=f"def {self.scope}", found="(absent)"
            )
        ours = _find_sequences(scope, statements(self.replacement))
        helpers_ok, helper_problem = self._helpers_state(tree)
        if len(ours) == 1 and helpers_ok:
            return Outcome(Verdict.APPLIED, f"{self.label}: in place in {self.file}:{self.scope}")
        if ours or helper_problem or _mentions_marker(scope):
            return Outcome.drifted(
                f"{self.label}: our edit in {self.file}:{self.scope} is present but not as we write it"
                + (f" ({helper_problem})" if helper_problem else ""),
                expected=textwrap.dedent(self.replacement).strip(),
            )
        anchors = _find_sequences(scope, statements(self.anchor))
        if len(anchors) == 1:
            return Outcome(
                Verdict.PENDING,
                f"{self.label}: anchor matches in {self.file}:{self.scope}",
                new_text=self._rewrite(text),
            )
        expected = textwrap.dedent(self.anchor).strip()
        if len(anchors) > 1:
            return Outcome.drifted(
                f"{self.label}: anchor matches {len(anchors)} times in {self.file}:{self.scope}, expected once",
                expected=expected,
            )
        return Outcome.drifted(
            f"{self.label}: anchor not found in {self.file}:{self.scope}",
            expected=expected,
            found=self._closest(scope, expected),
        )

    def _helpers_state(self, tree: ast.Module) -> tuple[bool, str | None]:
        """(all helpers in place, description of a helper present but changed)."""
        top = {_defined_name(n): n for n in tree.body}
        all_ok = True
        for helper in self.helpers:
            (node,) = ast.parse(textwrap.dedent(helper)).body
            name = _defined_name(node)
            present = top.get(name)
            if present is None:
                all_ok = False
            elif normalize_node(present) != normalize_node(node):
                return False, f"{name} differs from what we write"
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
    def _rewrite(self, text: str) -> str:
        import libcst as cst

        module = cst.parse_module(text)
        newline = module.default_newline

        def own_newlines(code: str) -> str:
            # multi-line strings keep their newlines verbatim: write them the file's way
            return textwrap.dedent(code).replace("\n", newline)

        anchor = statements(self.anchor)
        parsed = cst.parse_module(own_newlines(self.replacement))
        replacement = list(parsed.body)
        # libcst files comment lines above the first statement under the module header.
        comments = [line for line in parsed.header if line.comment is not None]

        class Replace(cst.CSTTransformer):
            done = 0

            def leave_IndentedBlock(self, original, updated):  # noqa: N802 (libcst API)
                body = list(updated.body)
                dumps = [statements(module.code_for_node(s)) for s in body]
                n = len(anchor)
                for i in range(len(body) - n + 1):
                    if [d[0] if len(d) == 1 else None for d in dumps[i : i + n]] == anchor:
                        first = replacement[0].with_changes(
                            leading_lines=[*body[i].leading_lines, *comments, *replacement[0].leading_lines]
                        )
                        body[i : i + n] = [first, *replacement[1:]]
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
        if self.helpers:
            present = {_cst_name(s) for s in body}
            new_helpers = []
            for helper in self.helpers:
                (stmt,) = cst.parse_module(own_newlines(helper)).body
                if _cst_name(stmt) in present:
                    continue
                blank = cst.EmptyLine(indent=False, whitespace=cst.SimpleWhitespace(""), comment=None)
                new_helpers.append(stmt.with_changes(leading_lines=[blank, blank, *stmt.leading_lines]))
            body[index:index] = new_helpers
        return module.with_changes(body=body).code


def _cst_name(stmt) -> str | None:
    """The name a module-level def, class or single-target assignment defines."""
    import libcst as cst

    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
            return small.targets[0].target.value
    return None


def _cst_index(body, name: str) -> int:
    import libcst as cst

    return next(
        i for i, s in enumerate(body) if isinstance(s, (cst.ClassDef, cst.FunctionDef)) and s.name.value == name
    )
