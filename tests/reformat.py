"""Reformatted copies of real releases: same code, other layout.

Another line length (black at 60 columns), single quotes instead of double,
and a comment line above every statement in every function. The AST of each
file is unchanged, so every patch must give the same verdicts and the same
edit; the copy's RECORD is rewritten to match, as a re-released wheel's would be.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import libcst as cst

from tests.releases import DSV4, cache_dir, cache_lock, copy_tree, pristine_tree, rewrite_record

COMMENT = "# reformatted copy: a comment line that changes nothing"


class _Relayout(cst.CSTTransformer):
    def __init__(self) -> None:
        self.depth = 0

    def visit_FunctionDef(self, node):  # noqa: N802
        self.depth += 1

    def leave_FunctionDef(self, original, updated):  # noqa: N802
        self.depth -= 1
        return self._comment(updated)

    def leave_SimpleStatementLine(self, original, updated):  # noqa: N802
        return self._comment(updated)

    def leave_If(self, original, updated):  # noqa: N802
        return self._comment(updated)

    def leave_For(self, original, updated):  # noqa: N802
        return self._comment(updated)

    def _comment(self, node):
        if self.depth == 0:
            return node
        line = cst.EmptyLine(comment=cst.Comment(COMMENT))
        return node.with_changes(leading_lines=[*node.leading_lines, line])

    def leave_SimpleString(self, original, updated):  # noqa: N802
        value = updated.value
        if value.startswith('"') and not value.startswith('"""') and "'" not in value and "\\" not in value:
            return updated.with_changes(value="'" + value[1:-1] + "'")
        return updated


def reformat_source(text: str) -> str:
    import black

    mode = black.Mode(line_length=60)
    try:
        text = black.format_str(text, mode=mode)
    except black.NothingChanged:
        pass
    out = cst.parse_module(text).visit(_Relayout()).code
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(text)), "reformatting changed the code"
    return out


def reformatted_tree(version: str) -> Path:
    """A cached pristine copy of ``version`` with every DeepSeek-V4 source reformatted."""
    target = cache_dir() / "trees" / f"vllm-{version}-reformatted"
    if (target / ".complete").exists():
        return target
    with cache_lock(f"reformatted-{version}"):
        if (target / ".complete").exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        copy_tree(pristine_tree(version), partial)
        changed = []
        for path in sorted((partial / DSV4).rglob("*.py")):
            text = path.read_text()
            new = reformat_source(text)
            if new != text:
                path.unlink()
                path.write_text(new)
                changed.append(str(path.relative_to(partial)))
        rewrite_record(partial, changed)
        (partial / ".complete").write_text(version)
        partial.rename(target)
    return target
