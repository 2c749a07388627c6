"""Real, fully installed vLLM venvs for the integration tests (marker ``real_vllm``).

Every test here is marked ``real_vllm`` (``pytest -m "not real_vllm"`` leaves them
out). The session fixture ``real_venvs`` builds the venvs once (tests/integration/venvs.py:
about 8 GB and 10 minutes per release on first use, cached after that), installs this
checkout into each once per session, and keeps them pristine: on first use and at
the end of the session it reverts a ``.patch-dsv4`` state left in the venv's
site-packages and, where vLLM's DeepSeek-V4 files still differ from the wheel's
RECORD, reinstalls vLLM (``--no-deps --force-reinstall``, from the test wheel cache).
A venv that cannot be built (no network) skips its tests with one reason line, except
where ``PATCH_DSV4_REQUIRE_REAL_VLLM=1`` (``.ci/run`` sets it): there it fails them.

vLLM sees no GPU in these processes (``CUDA_VISIBLE_DEVICES`` is empty). Each vLLM
import in a fresh process costs 10-40 s, so the tests group their checks into few
processes: :meth:`RealVenv.run_parts` runs several named parts in one process and
returns each part's result (or its traceback) on its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from patch_dsv4.tree.environment import record_digest

HERE = Path(__file__).resolve().parent
MARK = "real_vllm"
DSV4 = "vllm/models/deepseek_v4/"
RESULT = "PATCH_DSV4_RESULT="
TIMEOUT = 900


def pytest_collection_modifyitems(config, items):
    """Mark the tests here ``real_vllm`` and run them last, so that a venv building in the background (.ci/run)
    has the rest of the session to finish."""
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    for item in ours:
        item.add_marker(getattr(pytest.mark, MARK))
    chosen = set(map(id, ours))
    items[:] = [item for item in items if id(item) not in chosen] + ours


@dataclass
class Proc:
    """A finished process of a venv: its exit status and its output (stdout and stderr together)."""

    args: list[str]
    rc: int
    output: str
    seconds: float

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


@dataclass
class Part:
    ok: bool
    value: object = None
    error: str | None = None


@dataclass
class Parts:
    """The results of :meth:`RealVenv.run_parts`, one :class:`Part` per name."""

    proc: Proc
    parts: dict[str, Part] = field(default_factory=dict)

    def __getitem__(self, name: str):
        """The value a part returned; fails the calling test with the part's traceback if it raised."""
        if name not in self.parts:
            pytest.fail(f"part {name!r} gave no result (exit {self.proc.rc}):\n{self.proc.tail(60)}")
        part = self.parts[name]
        if not part.ok:
            pytest.fail(f"part {name!r} raised in the venv process:\n{part.error}")
        return part.value


_PRELUDE = """
import json, sys, traceback
PARAMS = json.loads({params!r})
RESULTS = {{}}

def part(name):
    def run(fn):
        try:
            RESULTS[name] = {{"ok": True, "value": fn()}}
        except BaseException:
            RESULTS[name] = {{"ok": False, "error": traceback.format_exc()}}
        return fn
    return run
"""
_EPILOGUE = """
sys.stdout.flush()
print({marker!r} + json.dumps(RESULTS, default=repr), flush=True)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a venv process: no GPU, no pip or guard settings of ours, nothing of the test venv."""
    dropped = ("PIP_", "PATCH_DSV4_", "VLLM_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PIP_FIND_LINKS="",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    env.update(extra)
    return env


@dataclass
class RealVenv:
    version: str
    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    @property
    def site(self) -> Path:
        (site,) = self.root.glob("lib/python3.*/site-packages")
        return site

    @property
    def state_dir(self) -> Path:
        return self.site / ".patch-dsv4"

    # -- processes ---------------------------------------------------------------
    def run(self, args: list[str], *, env: dict | None = None, timeout: float = TIMEOUT, cwd=None, merge=True) -> Proc:
        """Run ``args`` with :func:`clean_env`; ``output`` is stdout and stderr together (stdout alone without
        ``merge``)."""
        started = time.monotonic()
        done = subprocess.run(
            [str(a) for a in args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            text=True,
            env=clean_env(**(env or {})),
            timeout=timeout,
            cwd=cwd or self.root,
        )
        return Proc([str(a) for a in args], done.returncode, done.stdout, time.monotonic() - started)

    def run_parts(self, parts: list[str], *, params: dict | None = None, env: dict | None = None) -> Parts:
        """Run ``parts`` (code that defines ``@part("name")`` functions) in one fresh process of this venv."""
        script = _PRELUDE.format(params=json.dumps(params or {}))
        script += "\n".join(textwrap.dedent(p) for p in parts)
        script += _EPILOGUE.format(marker=RESULT)
        proc = self.run([self.python, "-c", script], env=env)
        lines = [line for line in proc.output.splitlines() if line.startswith(RESULT)]
        found = Parts(proc)
        if lines:
            for name, raw in json.loads(lines[-1][len(RESULT) :]).items():
                found.parts[name] = Part(raw["ok"], raw.get("value"), raw.get("error"))
        return found

    def cli(self, *args: str) -> dict:
        """This checkout's ``patch-dsv4`` (the test runner's) on this venv: ``... --python <venv python> --json``."""
        proc = subprocess.run(
            [sys.executable, "-m", "patch_dsv4", *args, "--python", self.python, "--json"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        try:
            report = json.loads(proc.stdout)
        except json.JSONDecodeError as exc:
            raise AssertionError(
                f"patch-dsv4 {' '.join(args)} wrote no JSON (exit {proc.returncode}):\n{proc.stderr}"
            ) from exc
        assert report["exit_code"] == proc.returncode
        return report

    # -- the tree --------------------------------------------------------------------
    def dsv4_differences(self) -> list[str]:
        """vLLM's DeepSeek-V4 files that differ from the wheel's RECORD (missing ones included)."""
        (dist_info,) = self.site.glob("vllm-*.dist-info")
        differ = []
        for line in (dist_info / "RECORD").read_text().splitlines():
            path, digest, _ = line.rsplit(",", 2)
            if not path.startswith(DSV4) or not digest.startswith("sha256="):
                continue
            target = self.site / path
            if not target.is_file() or record_digest(target.read_bytes()) != digest[len("sha256=") :]:
                differ.append(path)
        return differ

    def verdicts(self) -> dict[str, str]:
        return {p["id"]: p["verdict"] for p in self.cli("status")["patches"]}

    def ensure_pristine(self) -> None:
        """No state of ours and every DeepSeek-V4 file as the wheel's RECORD has it."""
        if self.state_dir.exists():
            self.cli("revert")
        if self.dsv4_differences():
            from tests.releases import wheel

            self.run(
                [
                    self.python,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--force-reinstall",
                    str(wheel("vllm", self.version)),
                ]
            )
            if self.state_dir.exists():  # a state whose files pip has just replaced: let revert drop it
                self.cli("revert")
        left = self.dsv4_differences()
        assert not left and not self.state_dir.exists(), f"cannot restore the vLLM {self.version} venv: {left}"

    def ensure_applied(self) -> dict:
        """Apply what this release needs (this checkout's CLI, ``--python``); the apply report."""
        if self.state_dir.exists():
            report = self.cli("verify")
            if report["exit_code"] == 0:
                return report
            self.ensure_pristine()
        report = self.cli("apply")
        assert report["exit_code"] == 0, report
        return report


class RealVenvs:
    """The session's venvs: built (or found) and prepared once, restored at the end."""

    def __init__(self):
        self.ready: dict[str, RealVenv] = {}
        self.refused: dict[str, str] = {}
        self._held = None  # the lock on the venvs, held from the first use to the end of the session

    def get(self, version: str) -> RealVenv:
        if self._held is None:
            # The venvs are shared and written (apply, revert, reinstall): under pytest -n one worker uses
            # them at a time, the others wait here (one lock for all, so that no two workers wait on each other).
            from tests.integration import venvs

            path = venvs.venv_path(version).parent / ".in-use.lock"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._held = open(path, "w")  # noqa: SIM115 - closed in restore_all, at the end of the session
            fcntl.flock(self._held, fcntl.LOCK_EX)
        if version not in self.ready and version not in self.refused:
            try:
                self.ready[version] = self._prepare(version)
            except (subprocess.CalledProcessError, OSError) as exc:
                self.refused[version] = f"no real vLLM {version} venv: {_one_line(exc)}"
        if version in self.refused:
            if os.environ.get("PATCH_DSV4_REQUIRE_REAL_VLLM") == "1":
                pytest.fail(self.refused[version])
            pytest.skip(self.refused[version])
        return self.ready[version]

    @staticmethod
    def _prepare(version: str) -> RealVenv:
        from tests.integration import venvs

        log = sys.stderr
        started = time.monotonic()
        root = venvs.build(version, log=log)
        venv = RealVenv(version, root)
        venvs.install_this_project(root)
        venv.ensure_pristine()
        log.write(f"vLLM {version} venv ready in {time.monotonic() - started:.0f} s\n")
        return venv

    def restore_all(self) -> None:
        try:
            for venv in self.ready.values():
                venv.ensure_pristine()
        finally:
            if self._held is not None:
                self._held.close()


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, subprocess.CalledProcessError):
        text = f"{' '.join(map(str, exc.cmd[-3:]))} exited {exc.returncode}"
    return text.splitlines()[0] if text else type(exc).__name__


@pytest.fixture(scope="session")
def real_venvs():
    venvs = RealVenvs()
    yield venvs
    venvs.restore_all()


@pytest.fixture(scope="session")
def venv030(real_venvs) -> RealVenv:
    return real_venvs.get("0.30.0")


@pytest.fixture(scope="session")
def venv028(real_venvs) -> RealVenv:
    return real_venvs.get("0.28.0")
