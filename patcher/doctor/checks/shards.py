"""Pack checks on the files: the shard set, the index, the links (DOCTOR-FACTS.md A "Pack").

pack.shards, pack.index, pack.symlinks.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
from collections import defaultdict
from pathlib import Path

from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.pack import INDEX_NAME, first_of, pack_index, pack_scan

NUMBERED_SHARD = re.compile(r"model-([0-9]{1,9})-of-([0-9]{1,9})\.safetensors$")
LEFTOVER_SUFFIXES = (".incomplete", ".part")


# --------------------------------------------------------------------------- checks: files


def _leftovers(pack: Path) -> list[str]:
    found = []
    for folder in (pack, pack / ".cache" / "huggingface" / "download"):
        try:
            found += [str(p.relative_to(pack)) for p in folder.iterdir() if p.name.endswith(LEFTOVER_SUFFIXES)]
        except OSError:
            continue
    return sorted(found)


def _numbering_gaps(files: list[Path]) -> tuple[list[str], int]:
    """(the first missing shards of each numbered set, and a mixture of sets, at most 3 named; how many)."""
    totals: dict[str, set[int]] = defaultdict(set)
    for path in files:
        match = NUMBERED_SHARD.match(path.name)
        if match:
            totals[match.group(2)].add(int(match.group(1)))
    gaps, count = [], 0
    for total, numbers in sorted(totals.items()):
        width, n = len(total), 1
        inside = {number for number in numbers if 1 <= number <= int(total)}
        count += int(total) - len(inside)  # counted, not listed: a name may claim 999999999 shards
        while len(gaps) < 3 and n <= int(total):
            if n not in inside:
                gaps.append(f"model-{n:0{width}d}-of-{total}.safetensors")
            n += 1
    if len(totals) > 1:
        names = sorted(totals)
        gaps.append(
            f"shards of {len(totals)} different sets (of-{', of-'.join(names[:3])}"
            + (", ...)" if len(names) > 3 else ")")
        )
        count += 1
    return gaps, count


@check("pack.shards", needs=("pack",))
def check_shards(ctx: DoctorContext) -> Row:
    """FAIL on a gap in ``model-NNNNN-of-MMMMM``, a leftover ``*.incomplete``/``*.part``, a header that
    cannot be read, a tensor whose byte span is not dtype x shape, or ``8 + header_len + max_end`` not
    equal to the file size; a truncated shard fails mid-load (R README.md:38; L mtp_overlay.py
    read_header/validate_header)."""
    scan = pack_scan(ctx)
    source = ctx.source
    pack = shlex.quote(str(ctx.pack))
    redownload = source.redownload()
    if scan.listing_error:
        return Row(
            "pack.shards", FAIL, scan.listing_error + ".", f"Check the --pack path and its permissions ({pack})."
        )
    if not scan.files:
        return Row(
            "pack.shards",
            FAIL,
            f"{ctx.pack} holds no *.safetensors file.",
            f"Point --pack at the directory that holds the shards, or download them: {redownload}.",
        )
    gaps, gap_count = _numbering_gaps(scan.files)
    leftovers = _leftovers(source.local) if source.local is not None else []
    if scan.problems:
        first = scan.problems[0]
        if source.remote:
            fix = source.shard_fix(first)
        elif first.expected_size is not None:
            fix = (
                f"shard {first.path.name} is incomplete (expected {first.expected_size} bytes, found "
                f"{first.found_size}); resume the download: {redownload}."
            )
        else:
            fix = f"Re-download {first.path.name} (for a Hub pack: {redownload} resumes and repairs it)."
        detail = first_of([str(p) for p in scan.problems])
        return Row("pack.shards", FAIL, f"{len(scan.files)} shards: {detail}.", fix)
    if gaps:
        from patch_dsv4.doctor.checks.v41_tensors import absent_engram_layers, engram_tables_fix

        more = f" (and {gap_count - 1} more)" if gap_count > 1 else ""
        engram = absent_engram_layers(ctx)  # a V4.1 pack that leaves its Engram tables to the base's shards
        if engram:
            return Row(
                "pack.shards",
                FAIL,
                f"{len(scan.files)} shards, but {gaps[0]}{more} is missing, and the pack holds no Engram table: "
                "such a pack leaves them to the base checkpoint's shards (v41.engram-tables).",
                engram_tables_fix(engram),
            )
        return Row(
            "pack.shards",
            FAIL,
            f"{len(scan.files)} shards, but {gaps[0]}{more} is missing.",
            f"Download the missing shards: {redownload}.",
        )
    if leftovers:
        return Row(
            "pack.shards",
            FAIL,
            f"an interrupted download left {first_of(leftovers)} in the pack.",
            f"Finish the download ({redownload}), then delete the leftover files.",
        )
    return Row(
        "pack.shards",
        PASS,
        f"{len(scan.files)} shards, {scan.safetensors_bytes / 1e9:.2f} GB: every header is valid and every "
        "file is exactly as long as its header says.",
    )


@check("pack.index", needs=("pack",))
def check_index(ctx: DoctorContext) -> Row:
    """FAIL if ``model.safetensors.index.json`` leaves out a ``*.safetensors`` on disk that holds tensors
    (vLLM silently skips it) or names a file that is not there (FileNotFoundError) (V0.28.0
    model_loader/weight_utils.py:573-598; P README.md "Native ExLlamaV3 packs")."""
    source = ctx.source
    scan = pack_scan(ctx)
    if scan.listing_error:
        return Row("pack.index", SKIP, scan.listing_error + " (see pack.shards).")
    regenerate = "Regenerate the index from the files on disk (or delete it: the vcruz305 pack ships none)."
    index = pack_index(ctx)
    if index.absent:
        return Row("pack.index", PASS, f"no {INDEX_NAME}: vLLM loads every *.safetensors in the pack.")
    if index.error:
        return Row("pack.index", FAIL, index.error + ".", regenerate)
    weight_map = index.weight_map
    listed = set(weight_map.values())
    on_disk = {p.name for p in scan.files}
    # vLLM skipping a shard that holds no tensor loses nothing.
    unlisted = sorted(name for name in on_disk - listed if scan.tensor_counts.get(name, 1))
    absent = sorted(name for name in listed if not source.has_file(name))
    if unlisted:
        return Row(
            "pack.index",
            FAIL,
            f"{INDEX_NAME} does not list {first_of(unlisted)}; vLLM will silently skip it.",
            f"{INDEX_NAME} does not list {', '.join(unlisted)}; vLLM will silently skip them. " + regenerate,
        )
    if absent:
        return Row(
            "pack.index",
            FAIL,
            f"{INDEX_NAME} names {first_of(absent)}, which is not in the pack (FileNotFoundError at load).",
            f"Restore {', '.join(absent)} into the pack, or regenerate the index from the files on disk.",
        )
    return Row("pack.index", PASS, f"{INDEX_NAME} lists all {len(on_disk)} *.safetensors files, and each exists.")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _is_hub_cache_blob(pack: Path, target: str) -> bool:
    # A Hub cache snapshot (<repo>/snapshots/<rev>/) is made of links into <repo>/blobs/: that is its layout.
    real_pack = Path(os.path.realpath(pack))
    return real_pack.parent.name == "snapshots" and _inside(target, str(real_pack.parent.parent / "blobs"))


@check("pack.symlinks", needs=("pack",))
def check_symlinks(ctx: DoctorContext) -> Row:
    """FAIL on a dangling or looping symlink; WARN on a symlink out of the pack, since a derived pack
    then breaks when its source is deleted (L docs/LNA-CANON.md, Lessons; mtp_overlay.py link_source_files)."""
    pack = ctx.source.local
    if pack is None:
        return Row("pack.symlinks", SKIP, f"{ctx.pack} is on the Hub: it has no links on this disk.")
    try:
        entries = sorted(pack.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        return Row("pack.symlinks", SKIP, f"{pack} cannot be listed ({exc.strerror or exc}; see pack.shards).")
    broken, outside = [], []
    real_pack = os.path.realpath(pack)
    for entry in entries:
        if not entry.is_symlink():
            continue
        try:
            os.stat(entry)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                broken.append((entry.name, "a symlink loop"))
            else:
                broken.append((entry.name, f"a symlink to a missing file ({os.readlink(entry)})"))
            continue
        target = os.path.realpath(entry)
        if not _inside(target, real_pack) and not _is_hub_cache_blob(pack, target):
            outside.append(f"{entry.name} -> {target}")
    if broken:
        name, reason = broken[0]
        return Row(
            "pack.symlinks",
            FAIL,
            first_of([f"{n} is {r}" for n, r in broken]) + ".",
            f"{name} is {reason.split(' (')[0]}; copy the real file into the pack in its place "
            "(derived packs should not depend on the source pack).",
        )
    if outside:
        return Row(
            "pack.symlinks",
            WARN,
            f"{first_of(outside)} points outside the pack.",
            "Copy the linked files into the pack: deleting or moving the source pack would break this one.",
        )
    return Row("pack.symlinks", PASS, "no symlink in the pack is broken or leaves it.")
