"""doctor's shard reader against the safetensors library itself: the same verdict on every header.

Each case is a whole file (length, header, payload). Our verdict is "valid" when
:class:`Shard` opens it with no error and no size error; the library's is whether
``safetensors.deserialize`` (its Rust reader, the one ``safe_open`` uses) accepts
the same bytes. Both readers of ours are held to it: the ``json.loads`` fast path
and the exact reader, the latter also with chunks of a few bytes, so that every
token of every case crosses a chunk boundary somewhere.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from patch_dsv4.doctor.readers import safetensors as reader
from patch_dsv4.doctor.readers.safetensors import DTYPE_BITS, Budget, Shard, ShardError

U64 = 2**64 - 1


def shard_bytes(header: bytes | str, payload: int = 0) -> bytes:
    header = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(header)) + header + b"\0" * payload


def library_accepts(data: bytes) -> bool:
    """Whether the safetensors library loads ``data``; the test asking skips alone where it is not installed."""
    safetensors = pytest.importorskip("safetensors")
    try:
        safetensors.deserialize(data)
    except Exception:  # SafetensorError, and whatever the bindings raise on the way
        return False
    return True


def our_verdict(data: bytes, path: Path) -> tuple[bool, str]:
    path.write_bytes(data)
    try:
        with Shard(path) as shard:
            if shard.size_error:
                return False, str(shard.size_error)
            return True, json.dumps(shard.tensors, sort_keys=True)
    except ShardError as exc:
        return False, str(exc)


@pytest.fixture(params=["fast", "exact", "exact-in-tiny-chunks"])
def mode(request, monkeypatch):
    """Which of our readers judges: the fast path where it can, the exact reader always, or the exact reader
    reading 7 bytes at a time (every window and lookahead then spans several chunks)."""
    if request.param != "fast":
        monkeypatch.setattr(reader, "FAST_HEADER_LEN", -1)
    if request.param == "exact-in-tiny-chunks":
        monkeypatch.setattr(reader, "CHUNK", 7)
    return request.param


# ------------------------------------------------------------------ hand-written cases

T = '"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def one(entry: str, payload: int = 4) -> tuple[str, int]:
    return '{"t":' + entry + "}", payload


def extra(value: str) -> tuple[str, int]:
    return one('{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":' + value + "}", 1)


CASES = {
    "empty_object": ("{}", 0),
    "one_tensor": ("{" + T + "}", 4),
    "padded_with_spaces": ("{" + T + "}      ", 4),
    "leading_and_trailing_white_space": (" \t\r\n{" + T + "}\n", 4),
    "form_feed_is_no_white_space": ("{" + T + "}\f", 4),
    "metadata": ('{"__metadata__":{"format":"pt","k":""},' + T + "}", 4),
    "metadata_null": ('{"__metadata__":null,' + T + "}", 4),
    "metadata_last": ("{" + T + ',"__metadata__":{}}', 4),
    "metadata_value_int": ('{"__metadata__":{"a":1}}', 0),
    "metadata_value_null": ('{"__metadata__":{"a":null}}', 0),
    "metadata_list": ('{"__metadata__":[]}', 0),
    "metadata_string": ('{"__metadata__":"pt"}', 0),
    "metadata_twice": ('{"__metadata__":{},"__metadata__":{}}', 0),
    "metadata_key_escaped": ('{"__metad\\u0061ta__":{"a":"b"}}', 0),
    "metadata_duplicate_keys": ('{"__metadata__":{"a":"b","a":"c"}}', 0),
    "header_list": ("[]", 0),
    "header_string": ('"x"', 0),
    "header_number": ("1", 0),
    "header_empty": ("", 0),
    "header_white_space_only": ("   ", 0),
    "bom": ("\ufeff{}", 0),
    "trailing_comma": ("{" + T + ",}", 4),
    "trailing_garbage": ("{}x", 0),
    "trailing_nul": ("{}\0", 0),
    "two_values": ("{}{}", 0),
    "unquoted_key": ('{t:{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "entry_int": one("3", 0),
    "entry_null": one("null", 0),
    "entry_string": one('"F32"', 0),
    "entry_empty_object": one("{}", 0),
    "entry_list_form": one('["F32",[1],[0,4]]'),
    "entry_list_of_two": one('["F32",[1]]'),
    "entry_list_of_four": one('["F32",[1],[0,4],1]'),
    "entry_empty_list": one("[]", 0),
    "entry_fields_reordered": one('{"data_offsets":[0,4],"shape":[1],"dtype":"F32"}'),
    "entry_missing_shape": one('{"dtype":"F32","data_offsets":[0,0]}', 0),
    "entry_missing_dtype": one('{"shape":[1],"data_offsets":[0,4]}'),
    "entry_missing_offsets": one('{"dtype":"F32","shape":[1]}', 0),
    "entry_dtype_twice": one('{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}'),
    "entry_unknown_field": extra("[[[{}]]]"),
    "entry_unknown_field_twice": one('{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":1,"x":2}', 1),
    "entry_unknown_field_escaped_key": one('{"dtype":"U8","shape":[],"data_offsets":[0,1],"d\\u0074yp":1}', 1),
    "entry_key_escaped": one('{"d\\u0074ype":"F32","shape":[1],"data_offsets":[0,4]}'),
    "dtype_escaped": one('{"dtype":"F\\u00332","shape":[1],"data_offsets":[0,4]}'),
    "dtype_unknown": one('{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}', 2),
    "dtype_lower_case": one('{"dtype":"f32","shape":[1],"data_offsets":[0,4]}'),
    "dtype_F8_E4M3FN_is_not_a_safetensors_dtype": one('{"dtype":"F8_E4M3FN","shape":[1],"data_offsets":[0,1]}', 1),
    "dtype_list": one('{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}'),
    "dtype_int": one('{"dtype":32,"shape":[1],"data_offsets":[0,4]}'),
    "dtype_null": one('{"dtype":null,"shape":[1],"data_offsets":[0,4]}'),
    "dtype_unit_variant_map": one('{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}'),
    "dtype_map_not_null": one('{"dtype":{"F32":[]},"shape":[1],"data_offsets":[0,4]}'),
    "dtype_map_empty": one('{"dtype":{},"shape":[1],"data_offsets":[0,4]}'),
    "dtype_map_two_keys": one('{"dtype":{"F32":null,"F16":null},"shape":[1],"data_offsets":[0,4]}'),
    "dtype_trailing_nul": one('{"dtype":"F32\\u0000","shape":[1],"data_offsets":[0,4]}'),
    "dtype_long": one('{"dtype":"' + "F" * 5000 + '","shape":[1],"data_offsets":[0,4]}'),
    "shape_scalar": one('{"dtype":"F32","shape":[],"data_offsets":[0,4]}'),
    "shape_zero": one('{"dtype":"F32","shape":[0],"data_offsets":[0,0]}', 0),
    "shape_null": one('{"dtype":"F32","shape":null,"data_offsets":[0,0]}', 0),
    "shape_object": one('{"dtype":"F32","shape":{},"data_offsets":[0,0]}', 0),
    "shape_string": one('{"dtype":"F32","shape":"1","data_offsets":[0,4]}'),
    "shape_float": one('{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}'),
    "shape_exponent": one('{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}'),
    "shape_negative_zero": one('{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}', 0),
    "shape_negative": one('{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}'),
    "shape_bool": one('{"dtype":"F32","shape":[true],"data_offsets":[0,4]}'),
    "shape_leading_zero": one('{"dtype":"F32","shape":[01],"data_offsets":[0,4]}'),
    "shape_nested_list": one('{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}'),
    "shape_empty_lists": one('{"dtype":"F32","shape":[[],[],[]],"data_offsets":[0,4]}'),
    "shape_u64_max_then_zero": one(f'{{"dtype":"U8","shape":[{U64},0],"data_offsets":[0,0]}}', 0),
    "shape_past_u64_then_zero": one(f'{{"dtype":"U8","shape":[{U64 + 1},0],"data_offsets":[0,0]}}', 0),
    "shape_zero_then_huge": one('{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}', 0),
    "shape_overflow_then_zero": one('{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}', 0),
    "shape_bits_overflow_then_zero": one(f'{{"dtype":"F32","shape":[{2**62},0],"data_offsets":[0,0]}}', 0),
    "shape_bytes_overflow": one(f'{{"dtype":"F64","shape":[{2**62}],"data_offsets":[0,0]}}', 0),
    "shape_long_of_ones": one('{"dtype":"F32","shape":[' + ",".join(["1"] * 20000) + '],"data_offsets":[0,4]}'),
    "shape_long_of_twos": one('{"dtype":"F32","shape":[' + ",".join(["2"] * 20000) + '],"data_offsets":[0,4]}'),
    "shape_long_int": one('{"dtype":"F32","shape":[' + "1" * 5000 + '],"data_offsets":[0,4]}'),
    "offsets_three": one('{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}'),
    "offsets_one": one('{"dtype":"F32","shape":[1],"data_offsets":[4]}'),
    "offsets_empty": one('{"dtype":"F32","shape":[1],"data_offsets":[]}'),
    "offsets_object": one('{"dtype":"F32","shape":[1],"data_offsets":{"0":0,"1":4}}'),
    "offsets_float": one('{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}'),
    "offsets_negative": one('{"dtype":"U8","shape":[0],"data_offsets":[-1,0]}', 0),
    "offsets_reversed": one('{"dtype":"U8","shape":[0],"data_offsets":[4,0]}', 0),
    "offsets_u64_max": one(f'{{"dtype":"U8","shape":[0],"data_offsets":[{U64},{U64}]}}', 0),
    "offsets_past_u64": one(f'{{"dtype":"U8","shape":[0],"data_offsets":[0,{U64 + 1}]}}', 0),
    "span_too_short": one('{"dtype":"F16","shape":[4],"data_offsets":[0,4]}'),
    "F4_two": one('{"dtype":"F4","shape":[2],"data_offsets":[0,1]}', 1),
    "F4_odd": one('{"dtype":"F4","shape":[3],"data_offsets":[0,2]}', 2),
    "F6_four": one('{"dtype":"F6_E3M2","shape":[4],"data_offsets":[0,3]}', 3),
    "F6_one": one('{"dtype":"F6_E2M3","shape":[1],"data_offsets":[0,1]}', 1),
    "F4_bits_overflow": one(f'{{"dtype":"F4","shape":[{U64}],"data_offsets":[0,0]}}', 0),
    "gap_before_the_first": one('{"dtype":"F32","shape":[1],"data_offsets":[4,8]}', 8),
    "gap_between": (
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}',
        3,
    ),
    "overlap": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        8,
    ),
    "same_span_twice": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        4,
    ),
    "out_of_order": (
        '{"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        2,
    ),
    "empty_tensors_at_a_boundary": (
        '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8",'
        '"shape":[0],"data_offsets":[0,0]},"c":{"dtype":"U8","shape":[1],'
        '"data_offsets":[0,1]},"d":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}',
        1,
    ),
    "empty_tensor_inside_another": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}',
        8,
    ),
    "empty_tensor_past_the_end": (
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}}',
        1,
    ),
    "name_twice_last_wins": (
        '{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        8,
    ),
    "name_twice_first_would_fit": (
        '{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        4,
    ),
    "name_twice_the_first_invalid": ('{"t":3,"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_empty": ('{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_with_nul_escape": ('{"a\\u0000":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_with_raw_control": ('{"a\x01":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_with_raw_del": ('{"a\x7f":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_with_escapes": ('{"a\\"b\\\\c\\/d\\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_bad_escape": ('{"a\\x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_unicode": ('{"ü€😀":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_surrogate_pair": ('{"\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_lone_high_surrogate": ('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_lone_low_surrogate": ('{"\\udc00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_two_high_surrogates": ('{"\\ud800\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_upper_case_escape": ('{"\\u00C4\\uD83D\\uDE00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "name_long": ('{"' + "n" * 4000 + '":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "unknown_lone_surrogate": extra('"\\ud800"'),
    "unknown_key_lone_surrogate": one('{"dtype":"U8","shape":[],"data_offsets":[0,1],"\\ud800":1}', 1),
    "unknown_nested_125": extra("[" * 125 + "]" * 125),
    "unknown_nested_126": extra("[" * 126 + "]" * 126),
    "unknown_objects_nested_125": extra('{"a":' * 125 + "1" + "}" * 125),
    "unknown_objects_nested_126": extra('{"a":' * 126 + "1" + "}" * 126),
    "unknown_mixed_nesting": extra('[{"a":[{"b":[1,"x",null,true,false,-0,-1.5e-3,{}]}]},[],{}]'),
    "unknown_nan": extra("NaN"),
    "unknown_infinity": extra("-Infinity"),
    "unknown_true_cut": extra("tru"),
    "unknown_max_double": extra("1.7976931348623157e308"),
    "unknown_past_max_double": extra("1.8e308"),
    "unknown_past_max_double_negative": extra("-1.8e308"),
    "unknown_underflow": extra("1e-400"),
    "unknown_zero_huge_exponent": extra("0e99999"),
    "unknown_small_mantissa_big_exponent": extra("0.0000001e315"),
    "unknown_big_int": extra("123456789012345678901234567890"),
    "unknown_int_308_digits": extra("1" + "0" * 308),
    "unknown_int_310_digits": extra("1" + "0" * 310),
    "unknown_int_5000_digits": extra("1" + "0" * 5000),
    "unknown_long_fraction": extra("0." + "0" * 400 + "1"),
    "unknown_float_no_digits": extra("1."),
    "unknown_leading_plus": extra("+1"),
    "unknown_exponent_plus": extra("1E+2"),
    "unknown_long_string": extra('"' + "s" * 100_000 + '"'),
    "unknown_list_of_empty_lists": extra("[" + ",".join(["[]"] * 5000) + "]"),
    "unknown_list_unclosed": extra("[1,2"),
    "unknown_list_trailing_comma": extra("[1,]"),
    "unknown_object_trailing_comma": extra('{"a":1,}'),
    "unknown_object_int_key": extra("{1:2}"),
    "unknown_string_bad_utf8": (b'{"t":{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":"\xff"}}', 1),
    "not_utf8": (b'{"\xff":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}', 1),
    "overlong_utf8": (b'{"\xc0\xaf":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}', 1),
    "encoded_surrogate": (b'{"\xed\xa0\x80":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}', 1),
    "cut_utf8": (b'{"\xe2\x82":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}', 1),
    "file_longer": ("{" + T + "}", 5),
    "file_shorter": ("{" + T + "}", 3),
    "all_dtypes": (
        "{"
        + ",".join(
            f'"{name}":{{"dtype":"{name}","shape":[8],"data_offsets":[{8 * i},{8 * i + bits}]}}'
            for i, name in enumerate(DTYPE_BITS)
            for bits in [DTYPE_BITS[name]]
        )
        + "}",
        8 * (len(DTYPE_BITS) - 1) + 64,
    ),
}


@pytest.mark.parametrize("header, payload", CASES.values(), ids=CASES.keys())
def test_our_verdict_is_the_librarys(header, payload, mode, tmp_path):
    data = shard_bytes(header, payload)
    ours, why = our_verdict(data, tmp_path / "x.safetensors")
    assert ours == library_accepts(data), why


def test_the_hand_written_cases_cover_both_verdicts():
    verdicts = [library_accepts(shard_bytes(h, p)) for h, p in CASES.values()]
    assert 30 < sum(verdicts) < len(verdicts) - 60


def test_both_readers_give_the_same_tensors(tmp_path, monkeypatch):
    for header, payload in CASES.values():
        data = shard_bytes(header, payload)
        fast = our_verdict(data, tmp_path / "x.safetensors")
        monkeypatch.setattr(reader, "FAST_HEADER_LEN", -1)
        exact = our_verdict(data, tmp_path / "x.safetensors")
        monkeypatch.undo()
        assert fast[0] == exact[0], (header[:80], fast, exact)
        if fast[0]:
            assert fast[1] == exact[1]


# ------------------------------------------------------------------ mutations of a good header


@dataclass(frozen=True)
class Raw:
    text: str  # JSON text written as it is (-0, NaN, 1e400, broken syntax)


class Obj(list):
    """A JSON object as a list of pairs: keys may repeat."""


def dumps(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def good_header():
    """Four tensors (one empty, one F4) behind a metadata map, laid out back to back: 35 bytes of data."""
    return Obj(
        [
            ("__metadata__", Obj([("format", "pt")])),
            ("a", Obj([("dtype", "F32"), ("shape", [2, 2]), ("data_offsets", [0, 16])])),
            ("b", Obj([("dtype", "F4"), ("shape", [4]), ("data_offsets", [16, 18])])),
            ("c", Obj([("dtype", "U8"), ("shape", [0]), ("data_offsets", [18, 18])])),
            ("d", Obj([("dtype", "BF16"), ("shape", [1, 8]), ("data_offsets", [18, 34])])),
        ]
    )


ODD_VALUES = [
    None,
    True,
    False,
    0,
    1,
    2,
    4,
    16,
    18,
    34,
    -1,
    Raw("-0"),
    1.0,
    Raw("1e2"),
    Raw("1e400"),
    Raw("NaN"),
    2**64 - 1,
    2**64,
    10**400,
    "",
    "F32",
    "F4",
    "U8",
    [],
    {},
    [1],
    [0, 16],
    [[]],
    Obj([("F32", None)]),
    Obj([("a", 1)]),
    ["F32", [1], [0, 4]],
    Raw("[" * 130 + "]" * 130),
    Raw('"\\ud800"'),
    Raw('"\\u00e9"'),
    Raw("[1,]"),
    Raw("tru"),
]


def paths(value, prefix=()):
    """Every place in a JSON value (object members by index, so repeated keys stay addressable)."""
    yield prefix
    if isinstance(value, Obj):
        for i, (_, child) in enumerate(value):
            yield from paths(child, prefix + (i,))
    elif isinstance(value, list) and not isinstance(value, Raw):
        for i, child in enumerate(value):
            yield from paths(child, prefix + (i,))


def replace(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, Obj):
        copy = Obj(value)
        key, child = copy[head]
        copy[head] = (key, replace(child, rest, new))
        return copy
    copy = list(value)
    copy[head] = replace(copy[head], rest, new)
    return copy


def get(value, path):
    for i in path:
        value = value[i][1] if isinstance(value, Obj) else value[i]
    return value


def mutations(seed: int, count: int):
    """``count`` headers, each a good one with one to three edits: a value replaced by an odd one, a member
    removed, repeated or renamed, an unknown field added, or bytes of the text changed."""
    rng = random.Random(seed)
    for _ in range(count):
        header = good_header()
        for _ in range(rng.randint(1, 3)):
            places = list(paths(header))
            path = rng.choice(places)
            kind = rng.randrange(6)
            target = get(header, path[:-1]) if path else None
            if kind <= 1 or not path:
                header = replace(header, path, rng.choice(ODD_VALUES))
            elif kind == 2 and isinstance(target, (Obj, list)):
                parent = Obj(target) if isinstance(target, Obj) else list(target)
                del parent[path[-1]]
                header = replace(header, path[:-1], parent)
            elif kind == 3 and isinstance(target, Obj):
                parent = Obj(target)
                parent.insert(rng.randrange(len(parent) + 1), parent[path[-1]])
                header = replace(header, path[:-1], parent)
            elif kind == 4 and isinstance(target, Obj):
                parent = Obj(target)
                parent[path[-1]] = (
                    rng.choice(["dtype", "shape", "data_offsets", "x", "__metadata__", "a"]),
                    parent[path[-1]][1],
                )
                header = replace(header, path[:-1], parent)
            elif kind == 5:
                entry = rng.choice("abcd")
                member = (
                    next(i for i, (k, _) in enumerate(header) if k == entry)
                    if any(k == entry for k, _ in header)
                    else None
                )
                if member is not None and isinstance(header[member][1], Obj):
                    fields = Obj(header[member][1])
                    fields.append((rng.choice(["x", "dtype", "extra"]), rng.choice(ODD_VALUES)))
                    header = replace(header, (member,), fields)
        if rng.random() < 0.5:  # as often, edits the library takes (for the verdict "valid" to be tried too)
            header = benign(rng, header if isinstance(header, Obj) and rng.random() < 0.5 else good_header())
        text = dumps(header)
        if rng.random() < 0.25:  # and sometimes the text itself
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice([" ", "\t", ",", "]", "}", "\\", '"', "0", "-", "\x01", "é", ""]) + text[i:]
        yield text, rng.choice([34, 34, 34, 34, 34, 33, 35, 0])


BENIGN_VALUES = [
    None,
    True,
    0,
    -1,
    Raw("-0"),
    1.5,
    Raw("-2.5e-3"),
    "",
    "x",
    "\u00e9",
    [],
    {},
    [[], [1, [2]]],
    Obj([("k", [None, {}])]),
    Raw("[" * 100 + "]" * 100),
    Raw('"\\ud83d\\ude00"'),
]


def benign(rng: random.Random, header: Obj) -> Obj:
    """``header`` with one edit the library accepts when ``header`` is valid: members reordered, an unknown
    field added, an entry written as a list, a dtype as ``{"F32": null}``, a metadata key repeated, white
    space in the text."""
    header = Obj(header)
    entries = [i for i, (k, v) in enumerate(header) if k != "__metadata__" and isinstance(v, Obj)]
    kind = rng.randrange(5)
    if kind == 0:
        rng.shuffle(header)
    elif entries and kind == 1:
        i = rng.choice(entries)
        fields = Obj(header[i][1])
        fields.insert(rng.randrange(len(fields) + 1), (rng.choice(["x", "y", "dtypes", ""]), rng.choice(BENIGN_VALUES)))
        header[i] = (header[i][0], fields)
    elif entries and kind == 2:
        i = rng.choice(entries)
        fields = dict(header[i][1])
        if {"dtype", "shape", "data_offsets"} <= set(fields):
            header[i] = (header[i][0], [fields["dtype"], fields["shape"], fields["data_offsets"]])
    elif entries and kind == 3:
        i = rng.choice(entries)
        fields = Obj((k, Obj([(v, None)]) if k == "dtype" and isinstance(v, str) else v) for k, v in header[i][1])
        header[i] = (header[i][0], fields)
    else:
        header.insert(0, ("__metadata__", Obj([("k", "1"), ("k", "2")])))
        header = Obj(pair for i, pair in enumerate(header) if pair[0] != "__metadata__" or i == 0)
    return header


@pytest.mark.parametrize("seed", range(4))
def test_mutated_headers_get_the_librarys_verdict(seed, mode, tmp_path):
    path = tmp_path / "x.safetensors"
    disagreements = []
    for text, payload in mutations(seed, 150):
        data = shard_bytes(text, payload)
        ours, why = our_verdict(data, path)
        if ours != library_accepts(data):
            disagreements.append((text, payload, ours, why))
    assert not disagreements, disagreements[:3]


def test_the_mutations_reach_both_verdicts():
    verdicts = [library_accepts(shard_bytes(t, p)) for t, p in mutations(0, 150)]
    assert 15 < sum(verdicts) < 135


# ------------------------------------------------------------------ what the rows say


@pytest.mark.parametrize(
    "header, payload, reason",
    [
        (
            '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}',
            3,
            "tensor 'b' begins at byte 2 of the data but the tensor before it, 'a', ends at 1: a gap",
        ),
        (
            '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            8,
            "tensor 'b' begins at byte 4, inside 'a' (which ends at 8)",
        ),
        (
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            8,
            "tensor 'a' begins at byte 4 of the data but the data begins at 0: a gap",
        ),
        (
            '{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}',
            4,
            "tensor 'a' has a dtype that is a JSON list, not a string",
        ),
        (
            '{"a":{"dtype":"F32","shape":[' + ",".join(["2"] * 70) + '],"data_offsets":[0,4]}}',
            4,
            "tensor 'a' has a shape whose size overflows 64 bits",
        ),
        (
            '{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
            4,
            "tensor 'a' shape[0] is a JSON float, not an unsigned integer",
        ),
        ('{"__metadata__":[]}', 0, "header __metadata__ is a JSON list, not an object"),
        ('{"__metadata__":{"k":1}}', 0, "header __metadata__ holds a JSON int where a string should be"),
        ('{"__metadata__":{},"__metadata__":{}}', 0, "header has __metadata__ twice"),
        (
            '{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}',
            2,
            "tensor 'a' is F4 x [3], 12 bits: not a whole number of bytes",
        ),
        ('{"' + "n" * 300 + '":3}', 0, "tensor 'nnnnn"),
    ],
)
def test_a_bad_header_names_the_shard_and_the_tensor(header, payload, reason, tmp_path):
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_bytes(shard_bytes(header, payload))
    with pytest.raises(ShardError) as caught:
        Shard(path).__enter__()
    assert str(caught.value).startswith("model-00001-of-00002.safetensors: ")
    assert reason in str(caught.value)
    assert len(str(caught.value)) < 400  # a long name is cut


def test_budgets_are_shared_by_the_shards_of_a_pack(tmp_path):
    header = "{" + ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(10))
    (tmp_path / "a.safetensors").write_bytes(shard_bytes(header + "}", 10))
    budget = Budget(tensors=15)
    with Shard(tmp_path / "a.safetensors", budget) as shard:
        assert len(shard.tensors) == 10
    with pytest.raises(ShardError, match="more than 1,000,000 tensors, more than doctor reads"):
        Shard(tmp_path / "a.safetensors", budget).__enter__()
