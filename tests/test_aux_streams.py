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
