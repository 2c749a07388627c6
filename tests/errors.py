"""Error lines as a person reads them: what, why and next on lines of their own (``patch-dsv4: error: ...``,
``patch-dsv4: why: ...``, ``patch-dsv4: next: ...``), a part longer than a line folded at spaces onto lines led by
``patch-dsv4:   ``, every line within 80 columns (a word longer than that, a long path, stands whole on its own).
:func:`error_lines` checks the width and joins those lines back into one line per error, ``what: why (next:
next)``, so that tests read one text whatever the width.
"""

from __future__ import annotations

MAX_LINE = 80


def fits(line: str, width: int = MAX_LINE) -> bool:
    """Whether a printed line keeps to ``width`` columns: it does, or it is one word too long for any line (a path
    under a long temporary directory, as pytest-xdist's workers make) standing alone after its lead."""
    return len(line) <= width or len(line.split()) <= 3


def error_lines(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert all(fits(line) for line in lines), stderr
    errors: list[dict[str, str]] = []  # each: its first line, and its why and next
    part = None
    for line in lines:
        if line.startswith("patch-dsv4:   ") and part is not None:  # a part too long for one line, folded
            errors[-1][part] += " " + line[len("patch-dsv4:   ") :]
        elif line.startswith(("patch-dsv4: why: ", "patch-dsv4: next: ")) and errors:
            part = line.split(": ", 2)[1]
            errors[-1][part] = line.split(": ", 2)[2]
        else:
            errors.append({"head": line})
            part = "head"
    return [
        e["head"] + (f": {e['why']}" if "why" in e else "") + (f" (next: {e['next']})" if "next" in e else "")
        for e in errors
    ]


def one_line(stderr: str) -> str:
    """The one error ``stderr`` holds, as :func:`error_lines` joins it; no traceback."""
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def exit_2_line(result, *words) -> str:
    """The one error line of a command that exited 2 (the environment cannot be used), holding each of ``words``."""
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]
