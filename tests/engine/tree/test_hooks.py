"""Start-up hooks that name vLLM (sitecustomize, usercustomize, .pth lines that run code) are named by status and
verify (a note of one line each, and the JSON document's hooks) and by doctor (a warn row, rt.hooks); nothing of a
hook is run, and a hostile one is read no further than its limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest

from patch_dsv4.tree import environment, hooks, pip_index
from tests.conftest import ROOT

SCHEMA = json.loads((ROOT / "patcher" / "report.schema.json").read_text())
#: A sitecustomize as a V4.1 kit ships one: it reaches into vLLM at start-up (and would leave a trace if it ran).
SITECUSTOMIZE = """\
import os
# vllm is patched below
open(os.environ.get("HOOK_RAN", "/dev/null"), "w").write("ran")
import vllm.model_executor.models.deepseek_v4 as dsv4
from vllm.multimodal import budget
budget.text_only_max_image_tokens = lambda *a, **k: 0
"""
NOTE = " hooks vllm: verify covers files, not import-time changes"


def _hooked(tree, tmp_path) -> dict[str, str]:
    """A sitecustomize.py, a .pth that imports a kit module naming vLLM, and a .pth that names nothing of it."""
    (tree / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tree / "dsv4_kit.py").write_text("import sys\n\ndef install():\n    sys.modules['vllm'].ENGRAM = True\n")
    (tree / "zz-dsv4-kit.pth").write_text("# the kit's hook\nimport dsv4_kit; dsv4_kit.install()\n")
    (tree / "distutils-precedence.pth").write_text("import os; os.environ.setdefault('X', '1')\n")
    return {"sitecustomize": str(tree / "sitecustomize.py"), ".pth": str(tree / "zz-dsv4-kit.pth")}


def test_vllm_names_are_names_not_parts_of_words():
    text = "import vllm\nfrom vllm.a.b import c\nx = 'vllm.entrypoints.openai'\nmyvllm = 1\n"
    text += "# import vllm.x\nvllm_x = 2\n"
    assert hooks.vllm_names(text) == {"vllm", "vllm.a.b", "vllm.entrypoints.openai"}
    assert hooks.vllm_names("sys.modules['vllm'].X = 1") == {"vllm"}
    assert hooks.vllm_names("pyvllm.x; vllm2; a.vllm") == set()


def test_status_and_verify_name_each_hook_in_a_line_and_in_json(make_tree, cli, tmp_path, monkeypatch):
    tree = make_tree("0.30.0")
    files = _hooked(tree, tmp_path)
    ran = tmp_path / "ran"
    monkeypatch.setenv("HOOK_RAN", str(ran))
    notes = [f"sitecustomize.py{NOTE}", f"zz-dsv4-kit.pth{NOTE}"]
    status = cli("status", "--site-packages", tree, "--json").json()
    assert status["notes"] == notes
    assert status["hooks"] == [
        {
            "file": files["sitecustomize"],
            "kind": "sitecustomize",
            "modules": ["vllm.model_executor.models.deepseek_v4", "vllm.multimodal"],
            "via": None,
        },
        {"file": files[".pth"], "kind": ".pth", "modules": ["vllm"], "via": str(tree / "dsv4_kit.py")},
    ]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(status, SCHEMA)
    table = cli("status", "--site-packages", tree)
    assert all(f"note: {note}" in table.stdout.splitlines() for note in notes)  # one line each
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
    assert cli("apply", "--site-packages", tree).code == 0
    for run in (cli("verify", "--site-packages", tree, "--json"), _fresh_verify(tree)):  # the full path, the fast
        document = run if isinstance(run, dict) else run.json()
        assert document["exit_code"] == 0 and document["notes"] == notes and document["hooks"] == status["hooks"]
        jsonschema.validate(document, SCHEMA)
    assert not ran.exists()  # read, never run


def _fresh_verify(tree) -> dict:
    """verify --json in a fresh interpreter (its fast path answers on an applied tree)."""
    run = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "verify", "--site-packages", str(tree), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    document = json.loads(run.stdout)
    assert "hashes match the recorded state" in document["summary"]
    return document


def test_a_long_path_is_shortened_to_keep_the_note_in_80_columns(tmp_path):
    deep = tmp_path / ("a" * 60) / "site-packages"
    deep.mkdir(parents=True)
    (deep / "sitecustomize.py").write_text("import vllm\n")
    (found,) = hooks.find_hooks([str(deep)])
    for site in (None, str(tmp_path)):
        note = found.note(site)
        assert len(f"note: {note}") <= 80 and note.endswith(NOTE) and note.startswith("...")
    assert found.note(str(deep)) == f"sitecustomize.py{NOTE}"


def test_only_the_first_sitecustomize_runs_and_only_import_lines_of_a_pth(tmp_path):
    first, second = tmp_path / "first", tmp_path / "site-packages"
    for directory in (first, second):
        directory.mkdir()
    (first / "sitecustomize.py").write_text("print('hello')\n")  # runs, and names nothing of vLLM
    (second / "sitecustomize.py").write_text("import vllm\n")
    (second / "paths.pth").write_text("/opt/vllm/extra\n# import vllm\nvllm\n")  # path lines and a comment: not run
    (second / "usercustomize").mkdir()
    (second / "usercustomize" / "__init__.py").write_text("from vllm import envs\n")
    found = hooks.find_hooks([str(first), str(second)])
    assert [(h.kind, h.path, h.modules) for h in found] == [
        ("usercustomize", str(second / "usercustomize" / "__init__.py"), ("vllm",)),
    ]


@pytest.mark.parametrize("hostile", ["huge", "fifo", "not-utf8", "a-directory", "a-link-loop", "many-imports"])
def test_a_hostile_hook_is_read_in_bounds_and_never_run(hostile, tmp_path):
    """A sitecustomize of 64 MiB (vllm named past the first MiB), a FIFO, undecodable bytes, a directory, a link
    loop: read at most 1 MiB, never blocked on, never run; the huge one is named as not read whole."""
    site = tmp_path / "site-packages"
    site.mkdir()
    path = site / "sitecustomize.py"
    if hostile == "huge":
        with open(path, "wb") as fh:
            fh.write(b"# " + b"x" * (64 << 20) + b"\nimport vllm\n")
    elif hostile == "fifo":
        os.mkfifo(path)
    elif hostile == "not-utf8":
        path.write_bytes(b"\xff\xfe import vllm.\xff\n")
    elif hostile == "a-directory":
        path.mkdir()
    elif hostile == "many-imports":  # each module looked for on the path: the first FOLLOWED only
        (site / "many.pth").write_text("".join(f"import m{n}\n" for n in range(60_000)))  # under 1 MiB
        (site / f"m{hooks.FOLLOWED + 5}.py").write_text("import vllm\n")
    else:
        path.symlink_to(site / "loop.py")
        (site / "loop.py").symlink_to(path)
    (site / "evil.pth").write_bytes(b"import os; os.system('touch ran')\n" + b"\x00" * 10)
    found = hooks.find_hooks([str(site)])
    if hostile == "huge":
        (hook,) = found
        assert hook.modules == () and not hook.whole and hook.named() == "none it could read"
        # the note claims no more than was read
        note = hook.note(str(site))
        assert note == "sitecustomize.py may hook vllm (read in part): verify covers files only", note
        assert len(note) <= 74
    elif hostile == "not-utf8":
        (hook,) = found
        assert hook.modules == ("vllm",)
    else:
        assert found == []
    assert not (site / "ran").exists() and not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "line",
    [
        "import sys; import dsv4_kit",
        'import sys; __import__("dsv4_kit").install()',
        "import os; from dsv4_kit.boot import install; install()",
        "import importlib; importlib.import_module('dsv4_kit')",
    ],
)
def test_every_statement_of_a_pth_line_is_followed(line, tmp_path):
    """site runs a .pth line that begins with import whole: a module its second statement imports is followed."""
    site = tmp_path / "site-packages"
    (site / "dsv4_kit").mkdir(parents=True)
    (site / "dsv4_kit" / "__init__.py").write_text("TARGET = 'vllm.envs'\n")
    (site / "zz-kit.pth").write_text(line + "\n")
    (hook,) = hooks.find_hooks([str(site)])
    assert (hook.kind, hook.modules, hook.via) == (".pth", ("vllm.envs",), str(site / "dsv4_kit" / "__init__.py"))


def test_status_python_names_that_interpreters_own_hooks(make_tree, tmp_path):
    """--python EXE: the hooks on that interpreter's own site paths (a venv whose site-packages holds them, with the
    tree's vLLM reached through a .pth path line), read and never run: asking that interpreter for its path and
    asking its pip what the index serves run none of them."""
    tree = make_tree("0.30.0")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "tree.pth"), "w") as fh:
        fh.write(f"{tree}\n")
    ran = tmp_path / "ran"
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(f"open({str(ran / 'sitecustomize')!r}, 'w')\nimport vllm.envs\n")
    with open(os.path.join(site, "kit.pth"), "w") as fh:
        fh.write(f"import os; open({str(ran / 'pth')!r}, 'w')\n")
    ran.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "status", "--python", python, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    document = json.loads(run.stdout)
    assert run.returncode == 0, run.stderr
    assert [h["file"] for h in document["hooks"]] == [os.path.join(site, "sitecustomize.py")]
    assert document["hooks"][0]["modules"] == ["vllm.envs"]
    assert len(document["notes"]) == 1 and document["notes"][0].endswith(NOTE)
    # the venv has no pip: asked anyway (doctor's FlashInfer fix), it answers nothing, and runs no hook
    assert pip_index.index_versions("flashinfer-python", python=python, timeout=60) is None
    assert sorted(p.name for p in ran.iterdir()) == []
    # as site itself would find them (the venv's site-packages, the .pth's path line), its hooks left out
    assert str(tree) in [str(p) for p in environment.ask_interpreter(python).search_path]


def test_doctor_warns_naming_the_file_and_the_modules(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    files = _hooked(tree, tmp_path)
    rows = [r for r in cli("doctor", "--site-packages", tree, "--json").json()["checks"] if r["id"] == "rt.hooks"]
    assert [r["status"] for r in rows] == ["warn", "warn"]
    assert files["sitecustomize"] in rows[0]["detail"]
    assert "vllm.model_executor.models.deepseek_v4, vllm.multimodal" in rows[0]["detail"]
    assert files[".pth"] in rows[1]["detail"] and "through " + str(tree / "dsv4_kit.py") in rows[1]["detail"]
    assert rows[0]["fix"].startswith("read it; to serve vLLM as verified, set it aside: mv ")
    clean = make_tree("0.30.0")
    rows = [r for r in cli("doctor", "--site-packages", clean, "--json").json()["checks"] if r["id"] == "rt.hooks"]
    assert [r["status"] for r in rows] == ["pass"]
