"""Hostile packs and arguments: doctor judges the largest headers and configs in little memory and time,
answers type-wrong input with a row (never an internal error), and quotes what it read in short rows.

Memory is measured in a child process (its peak RSS); bench/bench_doctor_hostile.py runs the full-size
cases (99 MB headers, a 60 MB config) through the whole command.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patch_dsv4.doctor.fix_config import fix_config
from patch_dsv4.doctor.readers import pack as pack_module
from patch_dsv4.doctor.readers.base import CHECKS, FAIL, PASS, ROW_LIMIT, SKIP, DoctorContext, Row, run_checks
from patch_dsv4.doctor.readers.safetensors import Shard
from patch_dsv4.doctor.run import _register_checks
from patch_dsv4.output.errors import EnvironmentProblem
from tests.conftest import ROOT, run_cli
from tests.doctor.synthetic import (
    DSPARK,
    PACK_CHECKS,
    SMALL,
    SMALL_TP8,
    build_mixedk_pack,
    fake_vllm,
    lna_dense_config,
    mixedk_config,
    run_pack_checks,
    write_shard,
)
from tests.doctor.test_safetensors import shard_bytes
from tests.errors import error_lines

CHILD = """
import json, sys
from pathlib import Path
from patch_dsv4.doctor.readers.base import DoctorContext, run_checks
from tests.doctor.synthetic import PACK_CHECKS
rows = run_checks(DoctorContext(pack=Path(sys.argv[1])), PACK_CHECKS)
# VmHWM, not ru_maxrss: the latter counts the parent's memory too (the child is forked from it before exec).
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rss_mb": int(peak.split()[1]) / 1024, "rows": {row.id: [row.status, row.detail] for row in rows}}))
"""


def in_a_child(pack: Path, timeout: float = 30) -> dict:
    """The pack rows, judged in a fresh interpreter, and its peak RSS."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(pack)], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def filled(prefix: bytes, unit: bytes, suffix: bytes, size: int) -> bytes:
    return prefix + (unit * ((size - len(prefix) - len(suffix)) // len(unit))).rstrip(b",") + suffix


def add_shard(pack: Path, header: bytes, payload: int) -> None:
    with open(pack / "model-extra.safetensors", "wb") as fh:
        fh.write(shard_bytes(header, 0))
        fh.truncate(8 + len(header) + payload)


# ------------------------------------------------------------------ bounded memory and time


def test_a_header_of_empty_lists_in_an_ignored_field_is_valid_and_cheap(mixedk):
    """20 MB of [] in a field the library ignores: json.loads would build 7 million lists (~450 MB)."""
    pack = mixedk()
    add_shard(pack, filled(b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[', b"[],", b"]}}", 20 << 20), 4)
    child = in_a_child(pack)
    assert child["rows"]["pack.shards"][0] == PASS, child["rows"]["pack.shards"]
    assert child["rss_mb"] < 80


def test_a_header_of_empty_lists_as_a_shape_fails_at_once(mixedk):
    pack = mixedk()
    add_shard(pack, filled(b'{"t":{"dtype":"F32","data_offsets":[0,4],"shape":[', b"[],", b"]}}", 20 << 20), 4)
    child = in_a_child(pack)
    status, detail = child["rows"]["pack.shards"]
    assert status == FAIL and "model-extra.safetensors: tensor 't' shape[0] is a JSON list" in detail
    assert child["rss_mb"] < 80


def test_a_long_shape_is_judged_at_once(mixedk):
    """300,000 dimensions of 2: the size product was computed in full, a 300,000-bit integer, quadratically."""
    pack = mixedk()
    add_shard(pack, filled(b'{"t":{"dtype":"F32","data_offsets":[0,4],"shape":[', b"2,", b"]}}", 600_000), 4)
    status, detail = in_a_child(pack, timeout=20)["rows"]["pack.shards"]
    assert status == FAIL and "tensor 't' has a shape whose size overflows 64 bits" in detail


def test_a_big_config_is_refused_by_its_size_in_little_memory(mixedk):
    pack = mixedk()
    config = json.dumps(mixedk_config(SMALL))[:-1].encode() + b', "x": ['
    (pack / "config.json").write_bytes(filled(config, b"[],", b"]}", 60_000_000))
    child = in_a_child(pack)
    status, detail = child["rows"]["pack.config"]
    assert status == FAIL and "is 59,999,999 bytes, more than the 2,097,152 doctor reads" in detail
    assert child["rows"]["quant.method"][0] == SKIP and child["rows"]["pack.shards"][0] == PASS
    assert child["rss_mb"] < 60


def test_a_config_within_the_size_but_of_a_million_values_is_refused(mixedk):
    pack = mixedk()
    config = json.dumps(mixedk_config(SMALL))[:-1].encode() + b', "x": ['
    (pack / "config.json").write_bytes(filled(config, b"{},", b"]}", 2_000_000))
    row = run_pack_checks(pack)["pack.config"]
    assert row.status == FAIL and "holds more JSON values than doctor reads" in row.detail


def test_a_config_nested_700_deep_is_a_fail_row_and_fix_config_refuses_it(mixedk):
    pack = mixedk(edit_config=lambda config: config.update(quantization_config={"quant_method": "fp8"}))
    config = json.dumps(json.loads((pack / "config.json").read_text()))
    (pack / "config.json").write_text(config[:-1] + ', "x": ' + "[" * 700 + "]" * 700 + "}")
    rows = run_pack_checks(pack)
    assert rows["pack.config"].status == FAIL and "more than 64 deep" in rows["pack.config"].detail
    result = fix_config(pack)
    assert result.refused and "more than 64 deep" in result.refused and not result.changed


def test_a_failed_scan_is_kept_not_redone(mixedk, monkeypatch):
    calls = []

    def broken(pack):
        calls.append(pack)
        raise RuntimeError("a bug")

    monkeypatch.setattr(pack_module, "scan_pack", broken)
    rows = run_checks(DoctorContext(pack=mixedk()), PACK_CHECKS)
    assert len(calls) == 1
    assert sum(row.detail.startswith("internal error") for row in rows) > 10


def test_fix_config_and_the_rows_after_it_read_each_header_once(mixedk, monkeypatch):
    pack = mixedk(edit_config=lambda config: config["quantization_config"].update(quant_method="fp8"))
    opened = []
    real_enter = Shard.__enter__
    monkeypatch.setattr(Shard, "__enter__", lambda self: opened.append(self.path.name) or real_enter(self))
    ctx = DoctorContext(pack=pack)
    assert fix_config(pack, ctx).changed
    rows = run_checks(ctx, PACK_CHECKS)
    assert {row.id: row.status for row in rows if row.status == FAIL} == {}
    assert sorted(opened) == sorted(p.name for p in pack.glob("*.safetensors"))


def test_the_scan_stops_summarising_past_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "MAX_SUMMARY", 100)
    pack = build_mixedk_pack(tmp_path / "pack")
    rows = run_pack_checks(pack)
    assert rows["pack.shards"].status == FAIL
    assert "not read: the shards before it name more experts, layers and modules than doctor summarises (100)" in (
        rows["pack.shards"].detail
    )


def test_a_shard_set_claiming_a_billion_shards_is_counted_not_listed(mixedk):
    pack = mixedk()
    write_shard(pack / "model-00001-of-999999999.safetensors", {})
    row = run_pack_checks(pack)["pack.shards"]
    assert (
        row.status == FAIL and "model-000000002-of-999999999.safetensors (and 999999998 more) is missing" in row.detail
    )


# ------------------------------------------------------------------ type-wrong input: rows, never internal errors

ODD = [
    None,
    True,
    False,
    0,
    -1,
    7,
    2**70,
    2**200,
    1.5,
    1e308,
    "",
    "x",
    "43",
    "²",
    "٣",
    [],
    [1],
    [None],
    {},
    {"a": 1},
    {"bits": "x"},
    [[[]]],
    {"0": None},
    {"quant_method": []},
    {"layers": []},
    {"modules": "x"},
    {"model.layers.0.attn.wq_b": 5},
    "x" * 5000,
    {"layers": {"model.layers.0.attn.wq_b": {"bits": [1]}}},
]
FLAGS = [
    "--tensor-parallel-size",
    "-tp",
    "--max-model-len",
    "--kv-cache-dtype",
    "--quantization",
    "--speculative-config",
    "--compilation-config",
    "--gpu-memory-utilization",
    "--max-num-batched-tokens",
]
FLAG_VALUES = [
    "",
    "0",
    "-1",
    "²",
    "1" * 50,
    "9" * 5000,
    "1e400",
    "nan",
    "inf",
    "256k",
    "9" * 40 + "k",
    "9" * 40 + "K",
    '{"method":"dspark","num_speculative_tokens":' + "9" * 500 + "}",
    '{"method":[]}',
    "[" * 3000,
    '{"cudagraph_mode": []}',
    '{"method":"dspark","num_speculative_tokens":true}',
    "fp8" * 50_000,
]


def _places(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _places(child, path + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value[:3]):
            yield from _places(child, path + (i,))


def _set(value, path, new):
    if not path:
        return new
    value = copy.copy(value)
    value[path[0]] = _set(value[path[0]], path[1:], new)
    return value


class Hang(Exception):
    pass


def _hang(*_):
    raise Hang("a check ran for more than 10 s")


@pytest.mark.parametrize("seed", range(3))
def test_type_wrong_configs_and_flags_give_rows_not_internal_errors(seed, tmp_path, lna):
    """Every check and --fix-config on configs with one to three values replaced by ones of other types,
    and on odd --serve-args values: no internal error, no exception, no check past 10 s, no long row."""
    _register_checks()
    rng = random.Random(seed)
    packs = {"mixedk": build_mixedk_pack(tmp_path / "mixedk"), "lna": lna()}
    configs = {"mixedk": mixedk_config(SMALL), "lna": lna_dense_config(SMALL_TP8)}
    runtime = fake_vllm(tmp_path / "site")
    previous = signal.signal(signal.SIGALRM, _hang)
    try:
        for _ in range(40):
            which = rng.choice(sorted(packs))
            pack, config, edits = packs[which], configs[which], []
            for _ in range(rng.randint(1, 3)):
                path, value = rng.choice(list(_places(config))), rng.choice(ODD)
                config = _set(config, path, value)
                edits.append((path, str(value)[:40]))
            args = [DSPARK.split(" ", 1)[0], DSPARK.split(" ", 1)[1].strip("'")] if rng.random() < 0.5 else []
            for _ in range(rng.randint(0, 3)):
                args += [rng.choice(FLAGS), rng.choice(FLAG_VALUES)]
            (pack / "config.json").write_text(json.dumps(config))
            (pack / "config.json.bak").unlink(missing_ok=True)
            ctx = DoctorContext(
                pack=pack, runtime=runtime, environ={"PATH": ""}, serve_args=tuple(args), proc_root=tmp_path / "no-proc"
            )
            signal.alarm(10)
            rows = run_checks(ctx, CHECKS)
            fixed = fix_config(pack)
            signal.alarm(0)
            crashed = [row for row in rows if row.detail.startswith("internal error")]
            assert not crashed, (edits, [a[:60] for a in args], crashed)
            assert all(len(row.detail) <= ROW_LIMIT + 40 for row in rows)
            assert fixed.refused is None or "internal" not in fixed.refused
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ short output


def test_an_echoed_serve_argument_is_cut_with_its_length():
    from patch_dsv4.doctor.checks.environ import recipe_flags

    ctx = DoctorContext.from_serve_args("--kv-cache-dtype " + "x" * 120_000 + " --quantization exl3")
    row = recipe_flags(ctx)
    assert len(row.detail) < 400 and "... (120,000 characters)" in row.detail


def test_an_echoed_config_value_is_cut_with_its_length(mixedk):
    pack = mixedk(edit_config=lambda config: config["quantization_config"].update(quant_method="q" * 120_000))
    row = run_pack_checks(pack)["quant.method"]
    assert row.status == FAIL and len(row.detail) < 600 and "... (120,002 characters)" in row.detail


def test_no_row_is_longer_than_the_row_limit():
    row = Row("x", FAIL, "d" * 50_000, "f" * 50_000)
    assert len(row.detail) <= ROW_LIMIT + 40 and len(row.fix) <= ROW_LIMIT + 40
    assert row.detail.endswith("... (50,000 characters)")


def test_unreadable_serve_args_are_a_short_one_line_error(make_tree, tmp_path):
    tree = make_tree("0.30.0")
    result = run_cli("doctor", "--site-packages", tree, "--serve-args", "--kv-cache-dtype '" + "x" * 120_000)
    assert result.code == 2 and "--serve-args" in result.stderr
    (line,) = error_lines(result.stderr)  # what, why and next, each within 200 columns
    assert len(result.stderr) < 600 and "... (120,0" in line


def test_the_command_on_a_deep_config_with_fix_config_is_exit_1(make_tree, mixedk):
    pack = mixedk()
    config = json.dumps(json.loads((pack / "config.json").read_text()))
    (pack / "config.json").write_text(config[:-1] + ', "x": ' + "[" * 700 + "]" * 700 + "}")
    result = run_cli("doctor", "--site-packages", make_tree("0.30.0"), "--pack", pack, "--fix-config", "--json")
    assert result.code == 1, result.stderr[-2000:]
    report = result.json()
    assert "more than 64 deep" in report["config_fix"]["refused"]
    assert not [row for row in report["checks"] if row["detail"].startswith("internal error")]


def test_an_index_of_a_million_empty_lists_is_a_fail_row(lna):
    pack = lna()
    (pack / "model.safetensors.index.json").write_bytes(filled(b'{"weight_map": {}, "x": [', b"[],", b"]}", 10 << 20))
    row = run_pack_checks(pack, "--tensor-parallel-size 8")["pack.index"]
    assert row.status == FAIL and "holds more JSON values than doctor reads" in row.detail


@pytest.mark.parametrize("seed", range(4))
def test_the_cheap_json_bound_answers_as_the_full_count(seed):
    """json_cost_over spares four of json_cost's five counts where a count of '{' bounds the cost; its answer
    is the full count's at every limit around the cost, on header-like text, lists of lists and non-ASCII."""
    from patch_dsv4.doctor.readers.files import _count, json_cost, json_cost_over

    rng = random.Random(seed)
    header = json.dumps({f"t{i}": {"dtype": "I16", "shape": [1, 2], "data_offsets": [0, 4]} for i in range(50)})
    texts = [header.encode(), b"", b"{}", filled(b"[", b"[],", b"]", 5000), "é,{".encode() * 300]
    texts += [bytes(rng.choice(b'{[,:"a\xc3') for _ in range(rng.randrange(3000))) for _ in range(20)]
    for raw in texts:
        for byte in b'{[,:"':
            assert _count(raw, bytes([byte])) == raw.count(bytes([byte]))
        cost = json_cost(raw)
        for limit in (0, cost // 2, cost - 1, cost, cost + 1, 120 * cost):
            assert json_cost_over(raw, limit) == (cost > limit), (raw[:80], limit)


def test_a_shard_of_more_entries_than_doctor_keeps_is_a_fail_row_naming_the_limit(mixedk, monkeypatch):
    from patch_dsv4.doctor.readers import safetensors as reader

    monkeypatch.setattr(reader, "ENTRY_MEMORY", 20_000)
    monkeypatch.setattr(reader, "FAST_HEADER_LEN", -1)
    row = run_pack_checks(mixedk())["pack.shards"]
    assert row.status == FAIL and "describes more than doctor keeps of one shard" in row.detail


# ------------------------------------------------------------------ DeepSeek-V4.1's nested config


def _v41_edit(path: tuple, value):
    def edit(config):
        target = config
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


_DELETE = object()
V41_HOSTILE = [
    (("text_config",), [], "text_config is a JSON list"),
    (("text_config",), _DELETE, "config.json is flat (no text_config)"),
    (("text_config",), "deepseek", "text_config is a JSON str"),
    (("vision_config",), 7, "vision_config is a JSON int"),
    (("text_config", "num_hidden_layers"), "40", 'num_hidden_layers is a JSON str ("40")'),
    (("text_config", "num_hidden_layers"), 10**12, "doctor takes up to 100,000"),
    (("text_config", "hidden_size"), 2**200, "not a positive integer"),
    (("text_config", "n_routed_experts"), -384, "n_routed_experts is a JSON int (-384)"),
    (("text_config", "num_attention_heads"), True, "num_attention_heads is a JSON bool"),
    (("text_config", "engram_num_embeddings"), [2**70], "n/a"),
    (("text_config", "engram_num_embeddings"), [1, 2, 3], "engram_num_embeddings has 3 entries for 1 Engram layer"),
    (("text_config", "engram_layer_ids"), [10**9], "names a layer past num_hidden_layers"),
    (("text_config", "engram_layer_ids"), "1,14", "engram_layer_ids is a JSON str"),
    (("text_config", "engram_vocab_size"), 10**30, "engram_vocab_size is a JSON int"),
    (("text_config", "engram_head_dim"), 100, "not a multiple of 32"),
    (("text_config", "engram_max_ngram_size"), 1, "engram_max_ngram_size is 1"),
    (("text_config", "compress_ratios"), {"0": 1}, "compress_ratios is a JSON dict"),
    (("text_config", "num_nextn_predict_layers"), 10**7, "doctor takes up to 100,000"),
    (("text_config", "n_routed_experts"), 10**6, "n/a"),
    (("model_type",), "deepseek_v4", 'model_type is "deepseek_v4" and architectures'),
]


@pytest.mark.parametrize(
    "path, value, text", V41_HOSTILE, ids=[f"{'.'.join(p)}={str(v)[:12]}" for p, v, _ in V41_HOSTILE]
)
def test_hostile_v41_configs_are_failures_with_reasons(tmp_path, path, value, text):
    """Every check and --fix-config on a V4.1 config with one value made hostile: no internal error, no
    check past 10 s; where the config itself is wrong, v41.config fails quoting the reason (n/a: the value
    is well-formed but absurd, and the rows that read it must still answer)."""
    from tests.doctor.synthetic_v41 import SMALL41, build_v41_pack

    _register_checks()
    pack = build_v41_pack(tmp_path / "pack", SMALL41, edit_config=_v41_edit(path, value))
    ctx = DoctorContext(pack=pack, runtime=fake_vllm(tmp_path / "site", version="0.34.0"), environ={"PATH": ""})
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(10)
    try:
        rows = run_checks(ctx, CHECKS)
        fixed = fix_config(pack)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    crashed = [row for row in rows if row.detail.startswith("internal error")]
    assert not crashed, crashed
    assert all(len(row.detail) <= ROW_LIMIT + 40 for row in rows)
    assert fixed.refused is None or "internal" not in fixed.refused
    config_row = next(row for row in rows if row.id == "v41.config")
    if text != "n/a":
        assert config_row.status == FAIL and text in config_row.detail, config_row


@pytest.mark.parametrize("seed", range(2))
def test_type_wrong_v41_configs_give_rows_not_internal_errors(seed, tmp_path):
    """The random replacements above, on V4.1's nested config (routed-only and dense packs)."""
    from tests.doctor.synthetic_v41 import SMALL41, build_v41_pack, v41_config

    _register_checks()
    rng = random.Random(seed)
    packs = {kind: build_v41_pack(tmp_path / kind, SMALL41, kind=kind) for kind in ("routed", "dense")}
    runtime = fake_vllm(tmp_path / "site", version="0.34.0")
    previous = signal.signal(signal.SIGALRM, _hang)
    try:
        for _ in range(30):
            kind = rng.choice(sorted(packs))
            config, edits = v41_config(SMALL41, kind=kind), []
            for _ in range(rng.randint(1, 3)):
                path, value = rng.choice(list(_places(config))), rng.choice(ODD)
                config = _set(config, path, value)
                edits.append((path, str(value)[:40]))
            (packs[kind] / "config.json").write_text(json.dumps(config))
            (packs[kind] / "config.json.bak").unlink(missing_ok=True)
            args = rng.choice(["", "-tp 2 -ep --enable-ep-weight-filter --speculative-config.method dspark"])
            ctx = DoctorContext.from_serve_args(args, pack=packs[kind], runtime=runtime, environ={"PATH": ""})
            signal.alarm(10)
            rows = run_checks(ctx, CHECKS)
            fixed = fix_config(packs[kind])
            signal.alarm(0)
            crashed = [row for row in rows if row.detail.startswith("internal error")]
            assert not crashed, (edits, crashed)
            assert fixed.refused is None or "internal" not in fixed.refused
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ a hostile Hub: bounded in time and memory

HUB_REPO = "hostile/pack"
# ``python -m patch_dsv4`` that writes its peak RSS (kB) to $HWM_FILE as it exits.
PEAK_MAIN = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    with open(os.environ["HWM_FILE"], "w") as out:
        out.write(line.split()[1])
atexit.register(peak)
sys.argv[0] = "patch-dsv4"
runpy.run_module("patch_dsv4", run_name="__main__", alter_sys=True)
"""
ESCAPES = "\x1b]0;owned\x07\x1b[2J"  # a window title set, then the screen cleared
LATE = "no answer within the 6 s doctor gives the Hub, reading "
TOO_MANY = "the server refused it as too many requests"


@pytest.fixture(scope="module")
def hostile_hub(tmp_path_factory):
    """(a vLLM 0.34.0 tree, a small V4.1 pack, a runner of the doctor command against a stand-in Hub serving it)."""
    pytest.importorskip("huggingface_hub")
    from tests.doctor.synthetic_v41 import SMALL41, build_v41_pack
    from tests.releases import copy_tree, pristine_tree

    work = tmp_path_factory.mktemp("hostile-hub")
    tree = copy_tree(pristine_tree("0.34.0"), work / "site-packages")
    pack = build_v41_pack(work / "pack", SMALL41)

    def doctor(hub, *args: str) -> tuple[float, float, int, str, str]:
        """(seconds, peak RSS in MB, exit status, stdout, stderr) of doctor on the Hub pack, in a fresh process."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PATCH_DSV4_")) and "PROXY" not in k}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(work / "hf-home"), NO_PROXY="127.0.0.1")
        env.update(HF_HUB_DISABLE_TELEMETRY="1", HWM_FILE=str(work / "hwm"))
        command = [sys.executable, "-c", PEAK_MAIN, "doctor", "--site-packages", str(tree)]
        started = time.monotonic()
        proc = subprocess.run(
            [*command, "--pack", f"hf://{HUB_REPO}", *args], capture_output=True, text=True, env=env, timeout=120
        )
        seconds = time.monotonic() - started
        return seconds, int((work / "hwm").read_text()) / 1024, proc.returncode, proc.stdout, proc.stderr

    return tree, pack, doctor


@pytest.mark.parametrize(
    "switch, said",
    [
        ({"stall": {"tree"}}, "no answer within the 6 s doctor gives the Hub, reading its listing"),
        (
            {"trickle": {"tree", "head", "get", "cdn"}},
            "no answer within the 6 s doctor gives the Hub, reading config.json",
        ),
        (
            {"rate_limit": {"tree"}},
            "listing its files: the server refused it as too many requests (HTTP 429, Retry-After '100000')",
        ),
        ({"endless_pages": True}, "the listing runs past 100 pages"),
        ({"gzip_bomb": True}, "listing its files: more than the 16,777,216 bytes doctor reads (once decoded)"),
    ],
    ids=["listing-never-answers", "a-byte-a-second", "429-retry-after-100000", "endless-next-pages", "gzip-bomb"],
)
def test_a_hostile_hub_stops_doctor_with_one_line_in_bounded_time_and_memory(hostile_hub, switch, said):
    from tests.doctor.hub_server import serving

    _, pack, doctor = hostile_hub
    with serving({HUB_REPO: pack}, cdn=True) as hub:
        for name, value in switch.items():
            setattr(hub, name, value)
        seconds, rss, code, stdout, stderr = doctor(hub, "--hub-timeout", "6")
    (line,) = error_lines(stderr)
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    assert line.startswith(f"patch-dsv4: error: cannot read hf://{HUB_REPO} from {hub.endpoint}: {said}"), line
    assert seconds < 6 + 30  # the deadline, and the start of a Python process on a busy machine
    assert rss < 300


def test_the_hub_deadline_comes_from_the_environment_and_a_bad_one_is_one_line(hostile_hub, monkeypatch):
    from patch_dsv4.doctor.readers.hub import DEADLINE, hub_deadline

    assert hub_deadline(None, {}) == DEADLINE and hub_deadline(3, {"PATCH_DSV4_HUB_TIMEOUT": "9"}) == 3
    assert hub_deadline(None, {"PATCH_DSV4_HUB_TIMEOUT": "9"}) == 9
    for bad in ("soon", "0", "-1", "nan", "1e9"):
        with pytest.raises(EnvironmentProblem, match="PATCH_DSV4_HUB_TIMEOUT .* is not a number of seconds"):
            hub_deadline(None, {"PATCH_DSV4_HUB_TIMEOUT": bad})


def test_a_file_name_with_terminal_escapes_is_shown_escaped(hostile_hub):
    from tests.doctor.hub_server import serving

    _, pack, doctor = hostile_hub
    name = f"{ESCAPES}model-00009-of-00008.safetensors"
    with serving({HUB_REPO: pack}, cdn=True) as hub:
        hub.extra_files = {name: 4096}
        seconds, rss, code, stdout, stderr = doctor(hub, "--hub-timeout", "20")
        _, _, _, as_json, _ = doctor(hub, "--hub-timeout", "20", "--json")
    assert code == 1 and "Traceback" not in stderr
    assert not {"\x1b", "\x07"} & set(stdout + stderr + as_json)
    escaped = r"\x1b]0;owned\x07\x1b[2Jmodel-00009-of-00008.safetensors"
    assert escaped in stdout
    row = {row["id"]: row for row in json.loads(as_json)["checks"]}["pack.shards"]
    assert row["status"] == FAIL and f"{escaped}: is not on the server" in row["detail"]
    assert seconds < 60 and rss < 300
