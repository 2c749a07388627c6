"""aux-streams, the opt-in patch, on every real release: shown as opt-in until asked for, applied with
--with and kept by later applies, reverted byte for byte; its statement run as vLLM runs it."""

from __future__ import annotations

import ast
import types

import pytest

from patch_dsv4.patches import aux_streams
from patch_dsv4.patches.aux_streams import MODEL, MTP
from tests.conftest import RELEASE_PARAMS
from tests.injected import function_node
from tests.releases import content_snapshot, wheel_file

V41_MODEL = "vllm/models/deepseek_v41/nvidia/model.py"


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_opt_in_until_asked_then_kept(version, make_tree, cli):
    tree = make_tree(version)
    original = content_snapshot(tree)
    status = cli("status", "--site-packages", tree, "--json")
    assert status.patch("aux-streams")["verdict"] == "opt-in"
    assert "apply --with aux-streams" in status.patch("aux-streams")["detail"]
    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0
    assert applied.patch("aux-streams")["verdict"] == "opt-in"
    assert MTP not in applied.json()["changed_files"]
    assert cli("verify", "--site-packages", tree).code == 0  # an opt-in patch nobody asked for fails nothing

    asked = cli("apply", "--site-packages", tree, "--with", "aux-streams", "--json")
    assert asked.code == 0, asked.stderr
    assert asked.patch("aux-streams")["verdict"] == "applied"
    assert {MODEL, MTP} <= set(asked.json()["changed_files"])
    assert cli("verify", "--site-packages", tree).code == 0
    again = cli("apply", "--site-packages", tree, "--json")  # remembered: a plain apply keeps it
    assert again.code == 0 and again.json()["changed_files"] == []
    assert again.patch("aux-streams")["verdict"] == "applied"

    assert cli("revert", "--site-packages", tree).code == 0
    assert content_snapshot(tree) == original
    for relpath in (MODEL, MTP):
        assert (tree / relpath).read_bytes() == wheel_file(version, relpath)


def test_a_removed_aux_streams_edit_fails_verify_once_asked_for(make_tree, cli):
    tree = make_tree("0.33.0")
    assert cli("apply", "--site-packages", tree, "--with", "aux-streams").code == 0
    manifest = (tree / ".patch-dsv4" / "manifest.json").read_text()
    assert '"opt_in": [\n    "aux-streams"\n  ]' in manifest
    (tree / MTP).unlink()
    (tree / MTP).write_bytes(wheel_file("0.33.0", MTP))  # someone reinstalled that file
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 1 and "aux-streams" in verify.stderr


class _Stream:
    made = 0

    def __init__(self):
        _Stream.made += 1


@pytest.mark.parametrize(
    "environ,streams",
    [
        ({}, 3),
        ({"PATCH_DSV4_AUX_STREAMS": "0"}, None),
        ({"LNA_DSV4_AUX_STREAMS": "0"}, None),
        ({"PATCH_DSV4_AUX_STREAMS": "1"}, 3),
        ({"DSV41_EXL3_SERIAL_STREAMS": "1"}, None),
        ({"DSV41_EXL3_SERIAL_STREAMS": "0"}, 3),
    ],
    ids=["unset", "patch-dsv4-switch", "lna-switch", "on", "miaai-serial", "miaai-not-serial"],
)
@pytest.mark.parametrize("version", ["0.28.0", "0.34.0"])
def test_the_patched_statement_makes_streams_only_when_not_switched_off(
    version, environ, streams, make_tree, cli, monkeypatch
):
    tree = make_tree(version)
    assert cli("apply", "--site-packages", tree, "--with", "aux-streams", "--only", "aux-streams").code == 0
    for name, _off in aux_streams.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=_Stream))
    v41 = [(V41_MODEL, "DeepseekV4Model")] if (tree / V41_MODEL).exists() else []
    assert bool(v41) == (version != "0.28.0")
    for relpath, cls in ((MODEL, "DeepseekV4Model"), (MTP, "DeepSeekV4MultiTokenPredictor"), *v41):
        init = function_node(tree / relpath, cls, "__init__")
        (statement,) = [
            n for n in ast.walk(init) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "aux_stream_list"
        ]
        namespace = {"torch": torch, "_patch_dsv4_aux_streams_off": aux_streams._patch_dsv4_aux_streams_off}
        _Stream.made = 0
        exec(compile(ast.Module(body=[statement], type_ignores=[]), str(relpath), "exec"), namespace)  # noqa: S102
        made = namespace["aux_stream_list"]
        assert (None if made is None else len(made)) == streams and _Stream.made == (streams or 0)


def _guarded_subscripts(tree: ast.AST, names: set[str]) -> tuple[int, list[str]]:
    """(how many subscripts of ``names`` there are, the ones not under an ``X is not None`` test of that name)."""
    unguarded, count = [], 0

    def guards(test: ast.AST, name: str) -> bool:
        return ast.unparse(test) == f"{name} is not None"

    def visit(node: ast.AST, guarded: frozenset[str]) -> None:
        nonlocal count
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
            count += 1
            if node.value.id not in guarded:
                unguarded.append(ast.unparse(node))
        if isinstance(node, (ast.If, ast.IfExp)):
            inside = guarded | {n for n in names if guards(node.test, n)}
            visit(node.test, guarded)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, inside)
            for child in node.orelse if isinstance(node.orelse, list) else [node.orelse]:
                visit(child, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, frozenset())
    return count, unguarded


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_every_release_s_attention_takes_no_aux_streams(version, make_tree):
    """aux_stream_list=None is the path vLLM takes on ROCm: every use of the list in attention.py is guarded."""
    tree = ast.parse((make_tree(version) / "vllm/models/deepseek_v4/attention.py").read_text())
    count, unguarded = _guarded_subscripts(tree, {"aux_stream_list", "aux_streams"})
    assert count >= 3 and unguarded == [], unguarded


# -- shapes no release has: a switch upstream might write, and look-alikes that are none ---------------------------
HELPERS = "vllm/models/deepseek_v4/common/streams.py"
INIT = """\
import torch
from vllm import envs
from vllm.models.deepseek_v4.common.streams import make_aux_streams


class DeepseekV4Model(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
{body}
        self.layers = build(aux_stream_list=aux_stream_list)
"""
STREAMS = "[torch.cuda.Stream() for _ in range(3)]"
HELPER_OFF = f"""\
import os


def make_aux_streams():
    if os.environ.get("VLLM_DSV4_AUX_STREAMS", "1") == "0":
        return None
    return {STREAMS}
"""
HELPER_COUNT = """\
import os


def make_aux_streams():
    return [torch.cuda.Stream() for _ in range(int(os.environ.get("VLLM_DSV4_AUX_STREAMS", "3")))]
"""
AUX_SHAPES = {
    # fixes in spellings no release has
    "conditional-on-envs": (
        f"        aux_stream_list = None if envs.VLLM_DSV4_SERIAL_STREAMS else {STREAMS}",
        "",
        "upstream",
    ),
    "if-statement-on-environ": (
        f"        aux_stream_list = {STREAMS}\n"
        '        if os.environ.get("VLLM_DSV4_AUX_STREAMS") == "0":\n'
        "            aux_stream_list = None",
        "",
        "upstream",
    ),
    "helper-in-another-module": ("        aux_stream_list = make_aux_streams()", HELPER_OFF, "upstream"),
    # look-alikes: a setting read, but the streams are made whatever it says
    "setting-sets-the-count": ("        aux_stream_list = make_aux_streams()", HELPER_COUNT, "drifted"),
    "both-arms-make-streams": (
        f"        aux_stream_list = {STREAMS} if envs.VLLM_DSV4_AUX_STREAMS else [torch.cuda.Stream()]",
        "",
        "drifted",
    ),
    "platform-not-a-setting": (
        f"        aux_stream_list = None if current_platform.is_rocm() else {STREAMS}",
        "",
        "drifted",
    ),
}


@pytest.mark.parametrize("name", list(AUX_SHAPES))
def test_streams_switch_shapes_no_release_has(name):
    from patch_dsv4.patching.patch import Context

    body, helper, verdict = AUX_SHAPES[name]
    text = INIT.format(body=body)
    (edit,) = [e for e in aux_streams.AuxStreams.edits if e.file == MODEL]
    outcome = edit.evaluate(Context.from_texts({MODEL: text, HELPERS: helper}), text)
    assert outcome.verdict.value == verdict, outcome.detail
    if verdict == "upstream":
        assert outcome.detail.startswith(f"{MODEL}: DeepseekV4Model.__init__ makes no streams when asked"), (
            outcome.detail
        )
        if helper:
            assert f"{HELPERS}: make_aux_streams returns None" in outcome.detail, outcome.detail
