"""What pip's configured index serves of a project, as ``pip index versions`` lists it (nothing downloaded).

drift asks it whether the FlashInfer vLLM pins is served (release_wheel.flashinfer_pin_served); doctor asks it
which FlashInfer an install fix may name (checks/runtime.flashinfer_served), once a run for the same project,
interpreter, options and pip settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

_ASKED: dict[tuple, list[str] | None] = {}
_RUN_PIP = "import runpy\nsys.argv[0] = 'pip'\nrunpy.run_module('pip', run_name='__main__', alter_sys=True)\n"


def index_versions(
    project: str,
    pip_options: Sequence[str] = (),
    python: str | None = None,
    timeout: float = 120.0,
    remember: bool = False,
) -> list[str] | None:
    """The versions of ``project`` pip's index serves, newest first as pip lists them; None when pip could not
    say (no network, no such project, no pip in ``python``, past ``timeout`` seconds). ``python``: whose pip
    (and so whose configuration) is asked; this interpreter's by default. ``remember``: ask once a run for the
    same question (doctor's rows ask it several times)."""
    if not remember:
        return _ask(project, pip_options, python or sys.executable, timeout)
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PIP_")))
    key = (project, tuple(pip_options), python, settings)
    if key not in _ASKED:
        _ASKED[key] = _ask(project, pip_options, python or sys.executable, timeout)
    return _ASKED[key]


def _ask(project: str, pip_options: Sequence[str], python: str, timeout: float) -> list[str] | None:
    # that interpreter's pip, started as -m pip would be, but without running its start-up hooks (tree.environment)
    from patch_dsv4.tree.environment import SAFE_SITE

    args = ["index", "versions", project, "--disable-pip-version-check", *pip_options]
    command = [python, "-S", "-c", SAFE_SITE + _RUN_PIP, *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    listed = next((line for line in proc.stdout.splitlines() if line.startswith("Available versions:")), None)
    if proc.returncode != 0 or listed is None:
        return None
    return [v.strip() for v in listed.split(":", 1)[1].split(",") if v.strip()]
