"""Real vLLM installs for the integration tests: a venv per release, with all of vLLM's dependencies.

A real install takes the registry's own build of torch (the CUDA one vLLM pins):
pip's configuration on these machines offers a CPU build of torch 2.13.0 through
``PIP_FIND_LINKS``, which breaks torchvision and with it every
``vllm.models.deepseek_v4`` import, so the venv is built with that variable
emptied and without the machine's pip configuration file. The venvs are kept in
``$PATCH_DSV4_TEST_CACHE/venvs`` (about 8 GB each) and built once; this
project is installed into them afresh for every test session.

    python -m tests.integration.venvs 0.30.0 0.28.0    # build them ahead (CI does this first)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.releases import cache_dir

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ("0.30.0", "0.28.0")


def _pip_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_FIND_LINKS="", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def venv_path(version: str) -> Path:
    return cache_dir() / "venvs" / f"vllm-{version}"


def build(version: str, log=sys.stderr) -> Path:
    """The venv of ``vllm==version`` with every dependency, built once (a stamp marks it complete)."""
    path = venv_path(version)
    stamp = path / ".complete"
    if stamp.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".vllm-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return path
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        python = path / "bin" / "python"
        log.write(f"building a real vLLM {version} venv in {path} (about 8 GB, minutes)\n")
        log.flush()
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"vllm=={version}"], check=True, env=_pip_env())
        stamp.write_text(version)
    return path


def install_this_project(venv: Path, checkout: Path = ROOT) -> None:
    """This checkout (or another), installed (not editable) into the venv: its entry points included."""
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(checkout)],
        check=True,
        env=_pip_env(),
    )
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "libcst>=1.1",
            "typer>=0.12",
            "rich>=13",
            "packaging>=23",
        ],
        check=True,
        env=_pip_env(),
    )


if __name__ == "__main__":
    for version in sys.argv[1:] or RELEASES:
        print(build(version))
