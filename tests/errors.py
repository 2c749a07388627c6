"""Error lines as a person reads them in a log: one logical line per error.

Written to a pipe, an error is one line of at most 200 characters; a longer one stands as what, why and next on
lines of their own (``patch-dsv4: why: ...``, ``patch-dsv4: next: ...``), a part longer than a line folded onto
lines led by ``patch-dsv4:   ``. :func:`error_lines` checks the width
and joins those lines back into the one-line form, so that tests read the same text either way.
"""

from __future__ import annotations

MAX_LINE = 200


def error_lines(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert all(len(line) <= MAX_LINE for line in lines), stderr
    joined: list[str] = []
    for line in lines:
        if line.startswith("patch-dsv4:   ") and joined:  # a part too long for one line, folded
            joined[-1] += " " + line[len("patch-dsv4:   ") :]
        elif line.startswith("patch-dsv4: why: ") and joined:
            joined[-1] += ": " + line[len("patch-dsv4: why: ") :]
        elif line.startswith("patch-dsv4: next: ") and joined:
            joined[-1] += f" (next: {line[len('patch-dsv4: next: ') :]})"
        else:
            joined.append(line)
    return joined
