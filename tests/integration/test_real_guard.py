"""The serve guard in a real vLLM 0.30.0 install: called by vLLM's own ``load_general_plugins()``.

The guard is this checkout's ``vllm.general_plugins`` entry point ``patch_dsv4``
(installed into the venv, not editable). Each call below is the first
``vllm.plugins.load_general_plugins()`` of its process: a small server process of
the venv imports ``vllm.plugins`` once (the 15-20 s part) and forks one child per
call, which sets the call's environment, calls ``load_general_plugins()`` and exits
(1 when it raised); the child's whole output (vLLM's logger included) comes back.
The tree is put in each state (pending, applied, hand-edited) by the test runner
between calls. ``vllm serve --help`` runs as a fresh process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import RealVenv, clean_env

pytestmark = pytest.mark.real_vllm

VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
#: what the guard names for stream-load on a pristine 0.30.0: V4's vision class and V4.1's (nvidia/ and amd/)
STREAM_LOAD_FILES = f"{VL_MODEL}, vllm/models/deepseek_v41/amd/vl_model.py, vllm/models/deepseek_v41/nvidia/vl_model.py"
MESSAGE = "patch-dsv4: this vLLM lacks patches"
OURS = "patch-dsv4"
ANSWER = "PATCH_DSV4_CALL="

SERVER = r"""
import json, os, sys, tempfile, traceback
import vllm.plugins
print("READY", flush=True)
for line in sys.stdin:
    env = json.loads(line)
    fd, path = tempfile.mkstemp()
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            try:
                vllm.plugins.load_general_plugins()
                print("load_general_plugins() returned")
                code = 0
            except BaseException as exc:
                traceback.print_exc()
                code = 1
            print("GUARD_IMPORTED=%s" % ("patch_dsv4.guard" in sys.modules))
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(path) as fh:
        output = fh.read()
    os.close(fd)
    os.unlink(path)
    print("PATCH_DSV4_CALL=" + json.dumps({"rc": os.waitstatus_to_exitcode(status), "output": output}), flush=True)
"""


class GuardServer:
    def __init__(self, venv: RealVenv):
        self.venv = venv
        self.proc = subprocess.Popen(
            [venv.python, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
            cwd=venv.root,
        )
        self._read_until(lambda line: line.strip() == "READY")

    def _read_until(self, done) -> str:
        seen = []
        for line in self.proc.stdout:
            if done(line):
                return line
            seen.append(line)
        raise AssertionError(f"the guard server ended (exit {self.proc.wait()}):\n{''.join(seen[-40:])}")

    def call(self, **env: str | None) -> dict:
        """One child's ``load_general_plugins()`` with ``env`` (None removes a variable)."""
        self.proc.stdin.write(json.dumps(env) + "\n")
        self.proc.stdin.flush()
        line = self._read_until(lambda line: line.startswith(ANSWER))
        result = json.loads(line[len(ANSWER) :])
        result["guard_imported"] = "GUARD_IMPORTED=True" in result["output"]
        return result

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def venv(venv030):
    yield venv030
    venv030.ensure_pristine()


@pytest.fixture(scope="module")
def server(venv):
    server = GuardServer(venv)
    yield server
    server.close()


def _our_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if OURS in line and "GUARD_IMPORTED" not in line]


def assert_names(output: str, venv: RealVenv, *items: str):
    assert MESSAGE in output, output
    for item in items:
        assert item in output, f"{item!r} not in:\n{output}"
    assert f"Run: patch-dsv4 apply --python {venv.python} " in output, output


def test_strict_refuses_a_pending_tree(venv, server):
    venv.ensure_pristine()
    r = server.call(PATCH_DSV4_GUARD="strict")
    assert r["rc"] == 1 and r["guard_imported"], r["output"]
    assert "PatchesNotInPlace" in r["output"], r["output"]
    assert_names(r["output"], venv, f"stream-load is pending ({STREAM_LOAD_FILES})", "wide-swa is pending")


def test_warn_and_unset_log_an_error_on_a_pending_tree_and_let_vllm_start(venv, server):
    venv.ensure_pristine()
    for env in ({"PATCH_DSV4_GUARD": "warn"}, {"PATCH_DSV4_GUARD": None}):
        r = server.call(**env)
        assert r["rc"] == 0 and "load_general_plugins() returned" in r["output"], (env, r["output"])
        (line,) = _our_lines(r["output"])  # one line, through vLLM's logger (its format: level, date, file)
        assert line.startswith("ERROR ") and "[guard.py:" in line, line
        assert_names(line, venv, f"stream-load is pending ({STREAM_LOAD_FILES})", "wide-swa is pending")


def test_a_hand_edited_patched_file_is_named_as_modified(venv, server):
    venv.ensure_applied()
    path = venv.site / VL_MODEL
    applied = path.read_bytes()
    try:
        path.write_bytes(applied + b"\n# a local edit\n")
        strict = server.call(PATCH_DSV4_GUARD="strict")
        warn = server.call(PATCH_DSV4_GUARD="warn")
        unset = server.call(PATCH_DSV4_GUARD=None)
    finally:
        path.write_bytes(applied)
    assert strict["rc"] == 1, strict["output"]
    assert_names(strict["output"], venv, f"stream-load is modified ({VL_MODEL}")
    assert "wide-swa" not in strict["output"]  # still applied and intact
    for r in (warn, unset):
        assert r["rc"] == 0, r["output"]
        (line,) = _our_lines(r["output"])
        assert line.startswith("ERROR ")
        assert_names(line, venv, f"stream-load is modified ({VL_MODEL}")


def test_an_applied_tree_starts_without_a_word_of_ours(venv, server):
    venv.ensure_applied()
    for env in ({"PATCH_DSV4_GUARD": "strict"}, {"PATCH_DSV4_GUARD": "warn"}, {"PATCH_DSV4_GUARD": None}):
        r = server.call(**env)
        assert r["rc"] == 0 and r["guard_imported"], (env, r["output"])
        assert _our_lines(r["output"]) == [], r["output"]


def test_a_vllm_plugins_allowlist_must_name_the_guard(venv, server):
    venv.ensure_pristine()
    other = server.call(PATCH_DSV4_GUARD="strict", VLLM_PLUGINS="lora_filesystem_resolver")
    assert other["rc"] == 0 and not other["guard_imported"], other["output"]
    assert _our_lines(other["output"]) == []
    named = server.call(PATCH_DSV4_GUARD="strict", VLLM_PLUGINS="lora_filesystem_resolver,patch_dsv4")
    assert named["rc"] == 1 and named["guard_imported"]
    assert MESSAGE in named["output"]


def test_vllm_serve_help_refuses_a_pending_tree_in_strict_mode(venv):
    venv.ensure_pristine()
    proc = venv.run([venv.bin("vllm"), "serve", "--help"], env={"PATCH_DSV4_GUARD": "strict"})
    assert proc.rc != 0, proc.tail()
    assert "PatchesNotInPlace" in proc.output, proc.tail()
    assert_names(proc.output, venv, f"stream-load is pending ({STREAM_LOAD_FILES})", "wide-swa is pending")


# -- PATCH_DSV4_EXPECT: every rank compares what it serves with the image's fingerprint ----------
def _fingerprint(venv: RealVenv) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "status", "--fingerprint", "--python", venv.python],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def two_fingerprints(venv) -> dict[str, str]:
    """The venv's fingerprint applied with aux-streams, and applied without (the tree is left so)."""
    venv.ensure_pristine()
    assert venv.cli("apply", "--with", "aux-streams")["exit_code"] == 0
    aux = _fingerprint(venv)
    venv.ensure_pristine()
    venv.ensure_applied()
    return {"aux": aux, "plain": _fingerprint(venv)}


def test_expect_of_an_equal_tree_starts_silently(venv, server, two_fingerprints):
    venv.ensure_applied()
    for mode in ("strict", "warn"):
        r = server.call(PATCH_DSV4_GUARD=mode, PATCH_DSV4_EXPECT=two_fingerprints["plain"])
        assert r["rc"] == 0 and r["guard_imported"], r["output"]
        assert _our_lines(r["output"]) == [], r["output"]


def test_expect_of_a_tree_with_another_opt_in_stops_strict_and_warns_otherwise(venv, server, two_fingerprints):
    venv.ensure_applied()
    expected = two_fingerprints["aux"]
    strict = server.call(PATCH_DSV4_GUARD="strict", PATCH_DSV4_EXPECT=expected)
    assert strict["rc"] == 1 and "PatchesNotInPlace" in strict["output"], strict["output"]
    assert "aux-streams: applied there, opt-in here" in strict["output"]
    for env in ({"PATCH_DSV4_GUARD": "warn"}, {"PATCH_DSV4_GUARD": None}):
        r = server.call(PATCH_DSV4_EXPECT=expected, **env)
        assert r["rc"] == 0 and "load_general_plugins() returned" in r["output"], r["output"]
        (line,) = _our_lines(r["output"])
        assert line.startswith("ERROR ") and "not the tree PATCH_DSV4_EXPECT names" in line, line
        assert "opt-ins: aux-streams there, none here" in line and "aux-streams: applied there, opt-in here" in line


def test_vllm_serve_stops_on_another_fingerprint_in_strict_mode_and_logs_its_own_at_debug(venv, two_fingerprints):
    venv.ensure_applied()
    other = venv.run(
        [venv.bin("vllm"), "serve", "--help"],
        env={"PATCH_DSV4_GUARD": "strict", "PATCH_DSV4_EXPECT": two_fingerprints["aux"]},
    )
    assert other.rc != 0 and "PatchesNotInPlace" in other.output, other.tail()
    assert "aux-streams: applied there, opt-in here" in other.output
    same = venv.run(
        [venv.bin("vllm"), "serve", "--help"],
        env={
            "PATCH_DSV4_GUARD": "strict",
            "PATCH_DSV4_EXPECT": two_fingerprints["plain"],
            "VLLM_LOGGING_LEVEL": "DEBUG",
        },
    )
    # the guard let it pass (without a GPU, `vllm serve --help` may still fail later: "Failed to infer device type")
    assert "PatchesNotInPlace" not in same.output, same.tail()
    ours = [line for line in same.output.splitlines() if f"{OURS}: " in line]  # not the venv's path
    assert ours and all(line.startswith("DEBUG ") for line in ours), same.tail()
    assert any(two_fingerprints["plain"] in line for line in ours), ours
