"""Edits of different patches in one scope: disjoint anchors stand together, overlapping ones are refused.

The rule (patcher/patching/registry.py, check_together): two edits of one (file, scope) may stand together when no
statement one anchors on is part of the other's anchor or replacement, and each writes injected names of its
own there. Each is then judged on the file as it is (a sibling's injected name does not make it look drifted),
and the pending ones are written one after the other. The real case: loader-skips and exl3-wo-a-slices both
edit `DeepseekV4Model.load_weights` on 0.28.0 and 0.29.0.
"""

from __future__ import annotations

import pytest

from patch_dsv4.output.verdicts import Verdict
from patch_dsv4.patching import registry
from patch_dsv4.patching.edits import ReplaceStatements, Variant
from patch_dsv4.patching.patch import Context, Patch, Scope
from patch_dsv4.patching.registry import PatchDefinitionError
from patch_dsv4.pipeline.judge import judge
from tests.releases import content_snapshot

FILE = "vllm/models/toy.py"
SCOPE = Scope("Toy", "run")
SOURCE = """\
class Toy:
    def run(self, x):
        a = first(x)
        b = second(a)
        return b
"""


def _patch_dsv4_toy_one(value):
    """Written by patch-dsv4 (toy-one)."""
    return value


def _patch_dsv4_toy_two(value):
    """Written by patch-dsv4 (toy-two)."""
    return value


def _edit(pid: str, anchor: str, replacement: str, helper=None) -> ReplaceStatements:
    return ReplaceStatements(pid, FILE, SCOPE, (Variant(anchor, replacement),), helpers=(helper,) if helper else ())


ONE = _edit("toy-one", "a = first(x)", "# patch-dsv4 (toy-one): why\na = _patch_dsv4_toy_one(first(x))\n")
TWO = _edit("toy-two", "b = second(a)", "# patch-dsv4 (toy-two): why\nb = _patch_dsv4_toy_two(second(a))\n")


def _patch(pid: str, *edits: ReplaceStatements) -> type[Patch]:
    return type(pid.title().replace("-", ""), (Patch,), {"id": pid, "title": pid, "edits": edits, "__doc__": "t"})


def _judge(text: str, *patches):
    ctx = Context.from_texts({FILE: text})
    judgement = judge(ctx, [p() for p in patches], check_fit=False)
    verdicts = {pid: [o.verdict for _, o in pairs] for pid, pairs in judgement.outcomes.items()}
    return verdicts, judgement.planned.get(FILE)


def test_disjoint_anchors_of_two_patches_share_a_scope():
    registry.check_together([_patch("toy-one", ONE), _patch("toy-two", TWO)])


@pytest.mark.parametrize("order", ["one-then-two", "two-then-one", "together"])
def test_each_is_pending_until_written_then_applied_in_any_order(order):
    one, two = _patch("toy-one", ONE), _patch("toy-two", TWO)
    steps = {"one-then-two": [[one], [two]], "two-then-one": [[two], [one]], "together": [[one, two]]}[order]
    text, written = SOURCE, set()
    for step in steps:
        verdicts, planned = _judge(text, one, two)
        for pid in ("toy-one", "toy-two"):  # the sibling's name never makes an absent edit look drifted
            assert verdicts[pid] == [Verdict.APPLIED if pid in written else Verdict.PENDING]
        _, planned = _judge(text, *step)
        text = planned.decode()
        written |= {p.id for p in step}
    verdicts, planned = _judge(text, one, two)
    assert verdicts == {"toy-one": [Verdict.APPLIED], "toy-two": [Verdict.APPLIED]} and planned is None
    assert "a = _patch_dsv4_toy_one(first(x))" in text and "b = _patch_dsv4_toy_two(second(a))" in text
    # both orders give the same code (the statements stand where vLLM's stood)
    assert text == _judge(SOURCE, one, two)[1].decode()


@pytest.mark.parametrize(
    "second, why",
    [
        (_edit("toy-two", "a = first(x)", "# patch-dsv4 (toy-two): why\na = _patch_dsv4_toy_two(x)\n"), "anchors on"),
        (  # anchors on a statement the other writes
            _edit(
                "toy-two", "b = second(a)", "# patch-dsv4 (toy-two): why\nb = _patch_dsv4_toy_two(a)\nc = third(b)\n"
            ),
            None,
        ),
        (  # two statements, one of them the other's anchor
            _edit(
                "toy-two", "a = first(x)\nb = second(a)", "# patch-dsv4 (toy-two): why\nb = _patch_dsv4_toy_two(x)\n"
            ),
            "anchors on",
        ),
        (_edit("toy-two", "b = second(a)", "# patch-dsv4 (toy-two): why\nb = _patch_dsv4_toy_one(a)\n"), "both write"),
    ],
    ids=["same-anchor", "disjoint-writes", "anchor-spans-the-other", "same-injected-name"],
)
def test_overlapping_anchors_are_refused_at_discovery_naming_both(second, why):
    patches = [_patch("toy-one", ONE), _patch("toy-two", second)]
    if why is None:
        registry.check_together(patches)
        return
    with pytest.raises(PatchDefinitionError) as caught:
        registry.check_together(patches)
    line = caught.value.line()
    assert "patches toy-one and toy-two both edit" in line and "overlapping anchors" in line and why in line


def test_an_anchor_the_other_writes_is_refused():
    writes_it = _edit("toy-two", "b = second(a)", "# patch-dsv4 (toy-two): why\nb = _patch_dsv4_toy_two(a)\nc = d(b)\n")
    anchors_on_it = _edit("toy-three", "c = d(b)", "# patch-dsv4 (toy-three): why\nc = _patch_dsv4_toy_three(b)\n")
    with pytest.raises(PatchDefinitionError, match="patches toy-two and toy-three"):
        registry.check_together([_patch("toy-two", writes_it), _patch("toy-three", anchors_on_it)])


def test_two_edits_of_one_patch_in_one_scope():
    """dense-exl3's two score closures: one edit written, the other still pending, never drifted."""
    other = _edit("toy-one-b", "b = second(a)", "# patch-dsv4 (toy-one): why\nb = _patch_dsv4_toy_one_b(second(a))\n")
    both = _patch("toy-one", ONE, other)
    registry.check_together([both])
    half = SOURCE.replace("a = first(x)", "a = _patch_dsv4_toy_one(first(x))  # patch-dsv4 (toy-one): why")
    verdicts, planned = _judge(half, both)
    assert verdicts == {"toy-one": [Verdict.APPLIED, Verdict.PENDING]}
    assert "b = _patch_dsv4_toy_one_b(second(a))" in planned.decode()


def test_the_real_patches_pass_discovery():
    ids = {p.id for p in registry.discover_patches()}
    assert {"dense-exl3", "exl3-wo-a-slices", "loader-skips"} <= ids


# -- the real shared scope: loader-skips and exl3-wo-a-slices in DeepseekV4Model.load_weights (0.28, 0.29) --
LOAD_WEIGHTS = "DeepseekV4Model.load_weights"


def _load_weights_verdicts(cli, tree) -> dict[str, str]:
    status = cli("status", "--site-packages", tree, "--json").json()
    return {
        p["id"]: next(e["verdict"] for e in p["edits"] if e["scope"] == LOAD_WEIGHTS)
        for p in status["patches"]
        if p["id"] in ("loader-skips", "exl3-wo-a-slices")
    }


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0"])
@pytest.mark.parametrize("order", ["ours-first", "opt-in-first", "together"])
def test_two_patches_in_load_weights_apply_in_either_order_and_revert(version, order, make_tree, cli):
    tree = make_tree(version)
    pristine = content_snapshot(tree)
    assert _load_weights_verdicts(cli, tree) == {"loader-skips": "pending", "exl3-wo-a-slices": "pending"}
    if order == "ours-first":
        assert cli("apply", "--site-packages", tree).code == 0
        assert _load_weights_verdicts(cli, tree) == {"loader-skips": "applied", "exl3-wo-a-slices": "pending"}
        assert cli("status", "--site-packages", tree, "--json").verdicts()["exl3-wo-a-slices"] == "opt-in"
    elif order == "opt-in-first":
        first = cli("apply", "--site-packages", tree, "--with", "exl3-wo-a-slices", "--only", "exl3-wo-a-slices")
        assert first.code == 0, first.stderr
        assert _load_weights_verdicts(cli, tree) == {"loader-skips": "pending", "exl3-wo-a-slices": "applied"}
    done = cli("apply", "--site-packages", tree, "--with", "exl3-wo-a-slices")
    assert done.code == 0, done.stderr
    assert _load_weights_verdicts(cli, tree) == {"loader-skips": "applied", "exl3-wo-a-slices": "applied"}
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 0 and verify.verdicts()["exl3-wo-a-slices"] == "applied"  # remembered in the state
    assert cli("apply", "--site-packages", tree, "--json").json()["changed_files"] == []
    assert cli("revert", "--site-packages", tree).code == 0
    assert content_snapshot(tree) == pristine
