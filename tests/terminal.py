"""Commands run on a pseudo-terminal, as a user at a terminal sees them (tests of colour, progress, folding)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from tests.conftest import ROOT


def in_a_terminal(args: list[str], env_extra: dict | None = None, columns: int = 80) -> str:
    """Run the command with stdout and stderr on a pseudo-terminal; what it printed."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm", **(env_extra or {})}
    env.pop("NO_COLOR", None) if "NO_COLOR" not in (env_extra or {}) else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "patch_dsv4", *args], stdout=follower, stderr=follower, env=env, cwd=ROOT
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait()
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")
