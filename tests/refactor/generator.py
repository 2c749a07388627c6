"""Refactorings of every recorded release's code, judged in memory, and the confusion matrix of the verdicts.

What is generated. For a release (anchors/vllm-X.json records each patch's verdict per edit), the *sites* are the
functions of the DeepSeek-V4 and V4.1 packages (``vllm/models/deepseek_v4/``, ``deepseek_v41/``, ``deepseek_v4_1/``)
that the judgement of an edit recorded ``pending`` or ``upstream`` rests on: its own scope, and every function the
engine looked up while judging it on the release as pip installed it (``Context.recording_lookups``: a helper
followed, a method found through the MRO, a scope read for evidence). Nothing here names a patch's functions: a
new probe that reads another function makes it a site. A *variant* is a site rewritten by a chain of 1-3
transforms chosen by Hypothesis: rewrites that keep the behaviour (tests/refactor/transforms.py) and, at most once
per chain, an injection of a patch's defect (tests/refactor/injections.py). A transform that does not apply where
it is drawn is skipped; a chain none of whose transforms applies is not a variant (not counted).

How it is judged. A variant is the release's files with its changed and new files laid over them, in memory:
:class:`ReleaseCode` reads each file of the pristine tree once, and the variant is judged by the engine's own entry
point, ``patch_dsv4.pipeline.judge.judge`` over a ``patching.patch.Context`` (as ``drift --source`` judges a
release: a tree pip installed as it is, so no RECORD check). Each variant must compile, and in the functions the
chain changed or made, every global name must be bound in its module or a builtin (as many as the release left
unbound, no more); one that does not is a bug of the generator (counted as ``invalid``, never judged).

What is expected, by construction. The edits judged are those whose judgement rests on the variant's site (all
edits there for a behaviour-keeping chain; the injected patch's edits there for an injection):

- a behaviour-keeping chain on code recorded ``upstream``: the fix is present, ``upstream`` expected;
- a behaviour-keeping chain on code recorded ``pending``: the defect is present, ``pending`` or ``drifted`` (a
  rewrite of the anchored statements makes it ``drifted``), never ``upstream``;
- a chain with an injected defect: the defect is present, ``pending`` or ``drifted``, never ``upstream``.

The false verdicts, exactly (each counted per variant and judged edit):

- **false upstream**: the verdict is ``upstream`` where the defect is present (a behaviour-keeping chain on code
  recorded ``pending``, or any chain with an injected defect): the tool would skip a fix the code needs.
- **false pending**: the verdict is ``pending`` where the fix is present (a behaviour-keeping chain on code
  recorded ``upstream``): apply would patch over upstream's fix.
- **false drifted**: the verdict is ``drifted`` where the fix is present, on a behaviour-keeping chain (on code
  recorded ``upstream``): apply refuses, verify says do not serve, though nothing is needed. Its rate is over the
  behaviour-keeping judgements of code recorded ``upstream``.
- **other**: any other verdict than expected (``not-applicable``, ``applied``, ``foreign``...), listed too.

The targets (issue 37): 0 false upstream, 0 false pending, at most 2% false drifted.
"""

from __future__ import annotations

import difflib
import os
import textwrap
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.patching.patch import Context, Patch
from patch_dsv4.patching.registry import discover_patches
from patch_dsv4.pipeline.judge import judge
from patch_dsv4.releases import anchors_store
from patch_dsv4.releases.release_target import ReleaseTarget, open_source
from tests.refactor.injections import injections
from tests.refactor.source import (
    InvalidVariant,
    Site,
    check_compiles,
    check_names,
    function_node,
    in_packages,
    parse,
    unresolved,
)
from tests.refactor.transforms import State, Transform, keeping

FIX, DEFECT = "fix", "defect"
CORRECT, FALSE_UPSTREAM, FALSE_PENDING, FALSE_DRIFTED, OTHER = (
    "correct",
    "false upstream",
    "false pending",
    "false drifted",
    "other",
)
JUDGED = ("pending", "upstream")  # the recorded verdicts whose code the generator rewrites
DRIFTED_TARGET = 0.02


class ReleaseCode:
    """One release tree, each file read from disk once; judged with a variant's files laid over it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.target: ReleaseTarget = open_source(root)
        self.version = self.target.vllm_version
        self._bytes: dict[str, bytes | None] = {}

    def read_bytes(self, relpath: str) -> bytes | None:
        if relpath not in self._bytes:
            self._bytes[relpath] = self.target.read_bytes(relpath)
        return self._bytes[relpath]

    def text(self, relpath: str) -> str | None:
        data = self.read_bytes(relpath)
        return None if data is None else data.decode("utf-8")

    def context(self, files: dict[str, str] | None = None) -> Context:
        """A Context over the tree with ``files`` (path -> text) in place of (or beside) its own."""
        overlay = {path: text.encode() for path, text in (files or {}).items()}

        def read(relpath: str) -> bytes | None:
            return overlay[relpath] if relpath in overlay else self.read_bytes(relpath)

        target = self.target
        return Context(
            target.vllm_version,
            target.flashinfer_version,
            target.flashinfer_source,
            read,
            read_flashinfer_bytes=target.read_flashinfer_bytes,
            flashinfer_given=target.flashinfer_given,
            flashinfer_pin_served=target.flashinfer_pin_served,
        )

    def package_files(self) -> list[str]:
        """The Python files of the DeepSeek-V4 and V4.1 packages (relative paths)."""
        found = []
        models = self.root / "vllm" / "models"
        for package in ("deepseek_v4", "deepseek_v41", "deepseek_v4_1"):
            for path in sorted((models / package).rglob("*.py")) if (models / package).is_dir() else ():
                found.append(str(path.relative_to(self.root)))
        return found


@dataclass(frozen=True)
class EditRef:
    """An edit of a patch, its verdict recorded for the release, and the sites its judgement rests on."""

    patch: str
    index: int
    label: str
    file: str
    scope: str
    recorded: str
    sites: frozenset[Site]


@dataclass
class Plan:
    """What the generator may rewrite in one release."""

    release: ReleaseCode
    patches: list[Patch]
    edits: list[EditRef]
    sites: list[Site]
    notes: list[str] = field(default_factory=list)
    allowed: dict[Site, set[str]] = field(default_factory=dict)

    def edits_at(self, site: Site) -> list[EditRef]:
        return [e for e in self.edits if site in e.sites]

    def patches_at(self, site: Site) -> set[str]:
        return {e.patch for e in self.edits_at(site)}


def _as_site(release: ReleaseCode, file: str, what: str) -> Site | None:
    """The function a recorded look-up (``Class.method`` or ``function``) names, where the file defines it."""
    if not in_packages(file) or what == "<module>":
        return None
    text = release.text(file)
    if text is None:
        return None
    owner, _, func = what.rpartition(".")
    site = Site(file, owner or None, func)
    return site if function_node(parse(text), site) is not None else None


def plan_release(release: ReleaseCode, patches: Sequence[Patch] | None = None) -> Plan:
    """The edits recorded ``pending`` or ``upstream`` in anchors/ for the release, and the sites they rest on."""
    patches = list(patches) if patches is not None else discover_patches()
    record = anchors_store.load(release.version)
    if record is None:
        raise ValueError(f"anchors/ has no record of vLLM {release.version}")
    ctx = release.context()
    edits, notes = [], []
    for patch in patches:
        entry = record["patches"].get(patch.id)
        if entry is None:
            notes.append(f"{patch.id}: no record for vLLM {release.version}")
            continue
        anchors = entry["anchors"]
        for index, edit in enumerate(patch.edits):
            anchor = anchors[index] if index < len(anchors) else None
            if anchor is None or anchor["file"] != edit.file or anchor["scope"] != str(edit.scope):
                notes.append(f"{patch.id}: anchors/ and the patch list different edits ({edit.label})")
                continue
            if anchor["verdict"] not in JUDGED:
                continue
            with ctx.recording_lookups() as lookups:
                outcome = edit.evaluate(ctx, ctx.read(edit.file))
            if outcome.verdict.value != anchor["verdict"]:
                notes.append(
                    f"{patch.id}: {edit.label} is {outcome.verdict.value} on the pristine tree, "
                    f"{anchor['verdict']} in anchors/"
                )
            sites = {site for file, what, found in lookups if found and (site := _as_site(release, file, what))}
            own = _as_site(release, edit.file, str(edit.scope))
            if own is not None:
                sites.add(own)
            edits.append(
                EditRef(patch.id, index, edit.label, edit.file, str(edit.scope), anchor["verdict"], frozenset(sites))
            )
    sites = sorted({s for e in edits for s in e.sites}, key=Site.key)
    plan = Plan(release, patches, edits, sites, notes)
    for site in sites:
        plan.allowed[site] = unresolved(release.text(site.file), site, site.file)
    return plan


# -- variants -------------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """A site rewritten by the steps that applied: (transform, pick, what it did)."""

    release: str
    origin: Site
    steps: list[tuple[str, int, str]]
    files: dict[str, str]
    keeps: bool
    injected: str | None

    @property
    def spec(self) -> str:
        """What reproduces it: the site, then each step as name@pick (bench/refactorings.py --replay)."""
        return " ".join([str(self.origin), *(f"{name}@{pick}" for name, pick, _ in self.steps)])

    def chain(self) -> str:
        return " -> ".join(f"{name} ({detail})" for name, _pick, detail in self.steps)


def all_transforms(plan: Plan) -> tuple[tuple[Transform, ...], tuple[Transform, ...]]:
    return keeping(plan.release.package_files), injections()


def build(plan: Plan, origin: Site, chain: Sequence[tuple[Transform, int]]) -> Variant | None:
    """The variant ``chain`` makes of ``origin`` (None: no transform applied); InvalidVariant if it is not valid."""
    state = State(plan.release.text)
    site, steps, touched, keeps, injected = origin, [], set(), True, None
    for transform, pick in chain:
        step = transform.apply(state, site, pick)
        if step is None:
            continue
        state = state.then(step)
        site = step.site
        steps.append((transform.name, pick, step.detail))
        touched |= set(step.touched)
        if not transform.keeps:
            keeps, injected = False, transform.patch
    if not steps:
        return None
    check_compiles(state.files)
    allowed = plan.allowed.get(origin, set())
    check_names(state.files, {t: allowed for t in touched})
    return Variant(plan.release.version, origin, steps, state.files, keeps, injected)


def parse_spec(plan: Plan, spec: str) -> tuple[Site, list[tuple[Transform, int]]]:
    """The site and chain of a spec written by :attr:`Variant.spec`."""
    site_text, *steps = spec.split()
    keep, inject = all_transforms(plan)
    by_name = {t.name: t for t in (*keep, *inject)}
    chain = []
    for step in steps:
        name, _, pick = step.rpartition("@")
        if name not in by_name or not pick.isdigit():
            raise ValueError(f"not a step (name@pick, name one of the transforms): {step!r}")
        chain.append((by_name[name], int(pick)))
    return Site.parse(site_text), chain


# -- judging --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One judged edit of one variant."""

    release: str
    patch: str
    edit: str
    kind: str  # keep | inject
    expected: str  # fix | defect
    found: str  # the verdict
    verdict: str  # correct | false upstream | false pending | false drifted | other
    spec: str
    chain: str
    where: str
    detail: str


def expected_for(keeps: bool, recorded: str) -> str:
    return FIX if keeps and recorded == "upstream" else DEFECT


def classify(expected: str, found: str) -> str:
    if expected == FIX:
        return {"upstream": CORRECT, "pending": FALSE_PENDING, "drifted": FALSE_DRIFTED}.get(found, OTHER)
    return {"pending": CORRECT, "drifted": CORRECT, "upstream": FALSE_UPSTREAM}.get(found, OTHER)


def changed_lines(release: ReleaseCode, files: dict[str, str]) -> str:
    """file:line of the first line each variant file changes (a new file: its line 1)."""
    where = []
    for path in sorted(files):
        before = release.text(path)
        if before is None:
            where.append(f"{path}:1 (new)")
            continue
        matcher = difflib.SequenceMatcher(None, before.splitlines(), files[path].splitlines(), autojunk=False)
        first = next((j1 for tag, _i1, _i2, j1, _j2 in matcher.get_opcodes() if tag != "equal"), 0)
        where.append(f"{path}:{first + 1}")
    return ", ".join(where)


def judge_variant(plan: Plan, variant: Variant) -> list[Row]:
    """Judge the edits the variant's site bears on (for an injection: its patch's), through the engine."""
    edits = [e for e in plan.edits_at(variant.origin) if variant.keeps or e.patch == variant.injected]
    if not edits:
        return []
    wanted = {e.patch for e in edits}
    patches = [p for p in plan.patches if p.id in wanted]
    judgement = judge(plan.release.context(variant.files), patches, plan=False)
    rows = []
    where = changed_lines(plan.release, variant.files)
    for ref in edits:
        _edit, outcome = judgement.outcomes[ref.patch][ref.index]
        expected = expected_for(variant.keeps, ref.recorded)
        found = outcome.verdict.value
        rows.append(
            Row(
                plan.release.version,
                ref.patch,
                ref.label,
                "keep" if variant.keeps else "inject",
                expected,
                found,
                classify(expected, found),
                variant.spec,
                variant.chain(),
                where,
                outcome.detail,
            )
        )
    return rows


# -- a run ----------------------------------------------------------------------------------------------------------
@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    variants: int = 0
    per_transform: Counter = field(default_factory=Counter)
    invalid: list[str] = field(default_factory=list)  # variants that failed the checks (a generator bug)
    errors: list[str] = field(default_factory=list)  # transforms that crashed (a generator bug)
    seen: set[tuple[str, str]] = field(default_factory=set)
    seconds: float = 0.0

    def add(self, plan: Plan, origin: Site, chain: Sequence[tuple[Transform, int]]) -> None:
        try:
            variant = build(plan, origin, chain)
        except InvalidVariant as exc:
            self.invalid.append(f"{plan.release.version} {origin} {' '.join(f'{t.name}@{p}' for t, p in chain)}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - a transform's bug is reported with what reproduces it
            spec = " ".join([str(origin), *(f"{t.name}@{p}" for t, p in chain)])
            self.errors.append(f"{plan.release.version} {spec}: {type(exc).__name__}: {exc}")
            return
        if variant is None or (variant.release, variant.spec) in self.seen:
            return
        self.seen.add((variant.release, variant.spec))
        rows = judge_variant(plan, variant)
        if not rows:
            return
        self.variants += 1
        for name, _pick, _detail in variant.steps:
            self.per_transform[name] += 1
        self.rows += rows

    def false(self) -> list[Row]:
        return [r for r in self.rows if r.verdict != CORRECT]

    def count(self, verdict: str, rows: Sequence[Row] | None = None) -> int:
        return sum(1 for r in (self.rows if rows is None else rows) if r.verdict == verdict)

    def drifted_rate(self, rows: Sequence[Row] | None = None) -> float:
        rows = self.rows if rows is None else rows
        fix = [r for r in rows if r.kind == "keep" and r.expected == FIX]
        return (self.count(FALSE_DRIFTED, fix) / len(fix)) if fix else 0.0

    def meets_targets(self) -> bool:
        return (
            not self.count(FALSE_UPSTREAM) and not self.count(FALSE_PENDING) and self.drifted_rate() <= DRIFTED_TARGET
        )


def variant_strategy(plan: Plan):
    """Hypothesis's choice of a variant of ``plan``'s release: a site, 1-3 behaviour-keeping transforms, and at
    most one injection of the defect of a patch whose judgement rests on the site, each with a pick."""
    from hypothesis import strategies as st

    keep, inject = all_transforms(plan)

    @st.composite
    def draw_variant(draw):
        origin = draw(st.sampled_from(plan.sites))
        patches = plan.patches_at(origin)
        fitting = [t for t in inject if t.patch in patches]
        with_injection = bool(fitting) and draw(st.booleans())
        count = draw(st.integers(0 if with_injection else 1, 2))
        chain = [(draw(st.sampled_from(keep)), draw(st.integers(0, 63))) for _ in range(count)]
        if with_injection:
            at = draw(st.integers(0, len(chain)))
            chain.insert(at, (draw(st.sampled_from(fitting)), draw(st.integers(0, 63))))
        return origin, chain

    return draw_variant()


def run(plan: Plan, examples: int, seed: int = 0, results: Results | None = None) -> Results:
    """``examples`` variants of ``plan``'s release drawn by Hypothesis, judged into ``results``. The draw is
    seeded with ``seed`` and the release's version: the same sample on every run, another for each release."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    results = results if results is not None else Results()
    started = time.perf_counter()

    @with_seed(seed * 1_000_003 + zlib.crc32(plan.release.version.encode()))
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(variant_strategy(plan))
    def one(drawn):
        results.add(plan, *drawn)

    one()
    results.seconds += time.perf_counter() - started
    return results


def pristine(version: str) -> Path:
    from tests.releases import pristine_tree

    return pristine_tree(version)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# -- the matrix -----------------------------------------------------------------------------------------------------
COLUMNS = ("upstream", "pending", "drifted", "other")


def _found_column(found: str) -> str:
    return found if found in COLUMNS[:3] else "other"


def matrix_lines(rows: Sequence[Row], by: Callable[[Row], str], title: str) -> list[str]:
    """The confusion matrix of ``rows`` grouped by ``by`` (a patch, a release), in lines of at most 80 columns: per
    group, kind (keep: behaviour-keeping; inject: a defect injected) and what is expected (fix: the fix is
    present; defect: it is not), how many judgements found each verdict, and how many of them are false."""
    width = max([len(title), *(len(by(r)) for r in rows)]) + 2
    head = f"{title:<{width}}{'kind':<7}{'expect':<7}{'n':>6}{'up':>6}{'pend':>6}{'drift':>6}{'other':>6}{'false':>7}"
    lines = [head, "-" * len(head)]
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((by(row), row.kind, row.expected), []).append(row)
    for (group, kind, expected), members in sorted(groups.items()):
        found = Counter(_found_column(r.found) for r in members)
        false = sum(1 for r in members if r.verdict != CORRECT)
        lines.append(
            f"{group:<{width}}{kind:<7}{expected:<7}{len(members):>6}"
            + "".join(f"{found.get(c, 0):>6}" for c in COLUMNS)
            + f"{false:>7}"
        )
    lines.append("(expect fix: pend, drift and other are false; expect defect: up and other are)")
    return lines


def summary_lines(results: Results) -> list[str]:
    rows = results.rows
    fix = sum(1 for r in rows if r.kind == "keep" and r.expected == FIX)
    return [
        f"variants judged: {results.variants}, judgements: {len(rows)}",
        f"false upstream: {results.count(FALSE_UPSTREAM)} (target 0)",
        f"false pending:  {results.count(FALSE_PENDING)} (target 0)",
        f"false drifted:  {results.count(FALSE_DRIFTED)} of {fix} behaviour-keeping judgements of fixed code"
        f" ({100 * results.drifted_rate():.1f}%, target <= {100 * DRIFTED_TARGET:.0f}%)",
        f"other:          {results.count(OTHER)}",
        f"invalid variants: {len(results.invalid)}, transform errors: {len(results.errors)}",
    ]


def transform_lines(results: Results) -> list[str]:
    keep, inject = keeping(), injections()
    names = [t.name for t in (*keep, *inject)]
    width = max(len(n) for n in names) + 2
    return [f"{name:<{width}}{results.per_transform.get(name, 0):>6}" for name in names]


def false_lines(results: Results, limit: int | None = None) -> list[str]:
    """Each false verdict: release, patch, edit, expected and found, the chain, where it changed the code, the
    engine's detail (wrapped at 80 columns), and the command that reproduces it (one line, to copy)."""
    out = []

    def wrapped(label: str, text: str) -> list[str]:
        return textwrap.wrap(text, 78, initial_indent=f"  {label}: ", subsequent_indent="    ") or [f"  {label}:"]

    for row in results.false()[:limit]:
        out += [
            f"[{row.verdict}] vLLM {row.release} {row.patch}:",
            f"  {row.edit}",
            f"  expected {row.expected} ({row.kind}), found {row.found}",
            *wrapped("chain", row.chain),
            *wrapped("where", row.where),
            *wrapped("detail", row.detail[:400]),
            f"  python bench/refactorings.py --vllm-version {row.release} --replay '{row.spec}'",
        ]
    return out
