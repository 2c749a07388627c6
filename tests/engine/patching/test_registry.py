"""The rules every patch keeps, enforced at discovery, and the order patches apply in."""

from __future__ import annotations

import types

import pytest

from patch_dsv4.patching import registry
from patch_dsv4.patching.edits import ReplaceStatements, Variant
from patch_dsv4.patching.patch import Patch, Scope
from patch_dsv4.patching.registry import PatchDefinitionError, check_patch, discover_patches

FILE = "vllm/models/deepseek_v4/common/vl_model.py"
SCOPE = Scope("DeepseekV4ForConditionalGeneration", "load_weights")
GOOD = Variant(
    anchor="x = f(y)",
    replacement="# patch-dsv4 (toy): why\nx = _patch_dsv4_toy(y)\n",
)


def _patch_dsv4_toy(y):
    """Written by patch-dsv4 (toy)."""
    return y


def _patch_dsv4_toy_silent(y):
    return y


def not_prefixed(y):
    """Written by patch-dsv4 (toy)."""
    return y


def _toy(edit=None, **attrs) -> type[Patch]:
    namespace = {
        "__module__": __name__,
        "id": "toy",
        "title": "a toy patch",
        "edits": (edit or ReplaceStatements("toy edit", FILE, SCOPE, (GOOD,), helpers=(_patch_dsv4_toy,)),),
        **attrs,
    }
    return types.new_class("Toy", (Patch,), exec_body=lambda ns: ns.update(namespace))


def test_a_well_formed_patch_passes():
    check_patch(_toy())


@pytest.mark.parametrize(
    "broken,why",
    [
        (dict(id="Toy_Patch"), "lower-case words"),
        (dict(title=""), "title"),
        (dict(edits=()), "no edits"),
        (
            dict(edit=ReplaceStatements("e", FILE, SCOPE, (Variant("x = f(y)", "x = _patch_dsv4_toy(y)\n"),))),
            "marker comment",
        ),
        (
            dict(
                edit=ReplaceStatements("e", FILE, SCOPE, (Variant("x = f(y)", "# patch-dsv4 (toy): why\nx = g(y)\n"),))
            ),
            "calls no _patch_dsv4_",
        ),
        (
            dict(edit=ReplaceStatements("e", FILE, SCOPE, (Variant("x = _patch_dsv4_toy(y)", GOOD.replacement),))),
            "anchor names",
        ),
        (dict(edit=ReplaceStatements("e", FILE, SCOPE, (GOOD,), helpers=(not_prefixed,))), "is not named _patch_dsv4_"),
        (dict(edit=ReplaceStatements("e", FILE, SCOPE, (GOOD,), helpers=(_patch_dsv4_toy_silent,))), "docstring"),
        (dict(edit=ReplaceStatements("e", "setup.py", SCOPE, (GOOD,))), "not a source file of vllm/"),
        (dict(edit=ReplaceStatements("e", FILE, SCOPE, (Variant("x = (", GOOD.replacement),))), "does not parse"),
    ],
    ids=[
        "id",
        "title",
        "no-edits",
        "no-marker-comment",
        "no-injected-name",
        "anchor-injected",
        "helper-prefix",
        "helper-docstring",
        "file-outside-vllm",
        "anchor-syntax",
    ],
)
def test_a_patch_that_breaks_a_rule_is_refused(broken, why):
    edit = broken.pop("edit", None)
    with pytest.raises(PatchDefinitionError) as caught:
        check_patch(_toy(edit, **broken))
    assert why in caught.value.line()


def test_two_patches_on_one_scope_are_refused():
    first, second = _toy(), _toy(id="toy-two")
    with pytest.raises(PatchDefinitionError, match="both edit"):
        registry.check_together([first, second])


def test_patches_apply_in_the_order_of_their_ids():
    ids = [p.id for p in discover_patches()]
    assert ids == sorted(ids)
    assert {"dtype-policy", "loader-skips", "stream-load", "wide-swa"} <= set(ids)


def test_the_why_is_the_module_docstring():
    for patch in discover_patches():
        module = __import__(type(patch).__module__, fromlist=["__doc__"])
        assert patch.why() == module.__doc__.strip()
