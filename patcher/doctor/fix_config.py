"""``patch-dsv4 doctor --fix-config``: write the config.json edits the failing pack rows ask for.

The edits are those of the recipe's fixer for the stock/nightly route (R
scripts/fix_pack_config.py @94a0878, DOCTOR-FACTS.md A.1/A.2), made key by key
instead of replacing the whole ``quantization_config``: every key the pack's
rows do not need changed is kept. Packs outside the fixer's assumptions (a
dense-EXL3 ``non_routed_exl3`` pack, EXL3 draft experts, unreadable shards) are
refused with a one-line reason and nothing is written.

The original config.json is kept as ``config.json.bak`` (created once, never
overwritten); config.json is replaced atomically and keeps its mode; a second
run finds nothing to change and writes nothing.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from patch_dsv4.doctor.checks.config import fixer_refusal
from patch_dsv4.doctor.checks.v41_config import apply_edits, v41_config_edits
from patch_dsv4.doctor.readers.base import CONFIG_LIMIT, DoctorContext
from patch_dsv4.doctor.readers.family import V41
from patch_dsv4.doctor.readers.files import read_regular_file
from patch_dsv4.doctor.readers.pack import (
    FP8_DELEGATE,
    STOCK_POLICY,
    PackScan,
    declared_layer_bits,
    layer_bits_for,
    layer_bits_problems,
    majority_k,
    pack_scan,
    plain_bf16_dense,
    routing_bias_layers,
    source_mtp_problems,
    valid_bits,
    wanted_codebook,
)
from patch_dsv4.tree.fs import Dir, Owner, UnsafePath

BACKUP_SUFFIX = ".bak"  # the name the recipe's fixer uses, so either tool finds the other's backup


@dataclass(frozen=True)
class FixResult:
    """What ``fix_config`` did: ``diff`` is empty when nothing changed; ``refused`` says why nothing was tried."""

    config: Path | str  # a str names config.json of a pack on the Hub
    diff: str = ""
    backup: Path | None = None
    refused: str | None = None
    written: bool = True  # False: the edits are shown, not written (a pack on the Hub)

    @property
    def changed(self) -> bool:
        return bool(self.diff)


def _set(mapping: dict, key: str, value) -> None:
    if mapping.get(key, object()) != value:
        mapping[key] = value


def planned_config(cfg: dict, scan: PackScan) -> dict:
    """``cfg`` with the edits the pack rows ask for (the input is not modified)."""
    new = copy.deepcopy(cfg)
    if not isinstance(new.get("quantization_config"), dict):
        new["quantization_config"] = {}
    quant = new["quantization_config"]
    _set(quant, "quant_method", "exl3")
    bits = valid_bits(quant)
    if bits is None:
        bits = quant["bits"] = majority_k(scan)
    codebook = wanted_codebook(quant, scan)
    if codebook:
        quant["codebook"] = codebook
    if plain_bf16_dense(scan):
        _set(quant, "non_routed_dtype_policy", STOCK_POLICY)
    if layer_bits_problems(quant, scan):
        declared, _ = declared_layer_bits(quant)
        kept = {str(layer): k for layer, k in declared.items() if layer not in scan.layer_k()}
        quant["layer_bits"] = {**layer_bits_for(scan, bits), **kept}
    if scan.mtp_format() == "source" and source_mtp_problems(new, quant):
        _set(quant, "mtp_experts", "source")
        _set(quant, "mtp_experts_start_layer", new["num_hidden_layers"])
        delegate = quant.get("non_routed_quantization")
        if not (isinstance(delegate, dict) and delegate.get("quant_method")):
            quant["non_routed_quantization"] = dict(FP8_DELEGATE)
    if routing_bias_layers(new, scan):
        _set(new, "topk_method", "noaux_tc")
    if new.get("text_config") == {}:
        del new["text_config"]
    return new


def _dumps_like(original: str, data: dict) -> str:
    """``data`` as JSON in the original file's style (indent, ASCII escapes, final newline), so the
    diff shows the edits and not a reformat."""
    indent_match = re.search(r"\n([ \t]+)\"", original)
    indent = indent_match.group(1) if indent_match else None
    text = json.dumps(data, indent=indent, ensure_ascii=original.isascii())
    return text + "\n" if original.endswith("\n") else text


def _keep_original(directory: Dir, config: Path, original: bytes, owner: Owner) -> Path:
    """Create ``config.json.bak`` holding ``original``, unless a backup is already there (it then holds
    the config from before the first fix, which must survive)."""
    backup = config.with_name(config.name + BACKUP_SUFFIX)
    info = directory.lstat(backup.name)
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise OSError(f"{backup} exists and is not a regular file; move it away so the original can be kept")
    if info is None:
        directory.create_new(backup.name, original, owner)  # never replaces a backup that appeared meanwhile
    return backup


def fix_config(pack: Path, checks: DoctorContext | None = None) -> FixResult:
    """Write the config edits the failing pack rows ask for; see the module docstring.

    ``checks`` is the context the rows will be judged in after the fix: the shards'
    headers are scanned once, there, and both use that scan (config.json is read
    afresh by each, since this changes it).
    """
    config = pack / "config.json"
    ctx = DoctorContext(pack=pack)
    if checks is not None:
        ctx.seed("pack.scan", pack_scan(checks))
    refusal = fixer_refusal(ctx)
    if refusal:
        return FixResult(config, refused=refusal)
    try:
        original = read_regular_file(config, CONFIG_LIMIT)
        mode = stat.S_IMODE(os.stat(config).st_mode)
    except OSError as exc:
        return FixResult(config, refused=f"{config} cannot be read ({exc.strerror or exc})")
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError:
        return FixResult(config, refused=f"{config} is not UTF-8 text")
    cfg = ctx.raw_config()  # as written: a V4.1 config stays nested
    if ctx.pack_family() == V41:
        new = apply_edits(cfg, v41_config_edits(ctx))
    else:
        new = planned_config(cfg, pack_scan(ctx))
    existing_backup = config.with_name(config.name + BACKUP_SUFFIX)
    if new == cfg:
        return FixResult(config, backup=existing_backup if existing_backup.is_file() else None)
    new_text = _dumps_like(text, new)
    st = os.stat(config)
    owner = Owner(st.st_uid, st.st_gid, mode)
    try:
        with Dir.open(pack) as directory:
            backup = _keep_original(directory, config, original, owner)
            directory.write_atomic(config.name, new_text.encode("utf-8"), owner)
    except (OSError, UnsafePath) as exc:
        why = exc.line() if isinstance(exc, UnsafePath) else (exc.strerror or str(exc))
        return FixResult(config, refused=f"config.json was not changed: {why}")
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"{config} (before)",
            tofile=f"{config}",
        )
    )
    return FixResult(config, diff=diff, backup=backup)


def planned_fix(ctx: DoctorContext) -> FixResult:
    """The config.json edits the failing pack rows ask for, as a diff, for a pack doctor does not write (one on
    the Hub, read through ``ctx.source``): what ``fix_config`` would write there, nothing written.

    The edits are those ``fix_config`` writes: ``v41_config_edits`` for a V4.1 pack, else ``planned_config``."""
    source = ctx.source
    label = source.where("config.json")
    refusal = fixer_refusal(ctx)
    if refusal:
        return FixResult(label, refused=refusal, written=False)
    try:
        text = source.read_file("config.json", CONFIG_LIMIT).decode("utf-8")
    except OSError as exc:
        return FixResult(label, refused=f"{label} cannot be read ({exc.strerror or exc})", written=False)
    except UnicodeDecodeError:
        return FixResult(label, refused=f"{label} is not UTF-8 text", written=False)
    cfg = ctx.raw_config()  # as written: a V4.1 config stays nested
    if ctx.pack_family() == V41:
        new = apply_edits(cfg, v41_config_edits(ctx))
    else:
        new = planned_config(cfg, pack_scan(ctx))
    if new == cfg:
        return FixResult(label, written=False)
    new_text = _dumps_like(text, new)
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"{label} (as the Hub holds it)",
            tofile=f"{label} (as --fix-config would write it)",
        )
    )
    return FixResult(label, diff=diff, written=False)
