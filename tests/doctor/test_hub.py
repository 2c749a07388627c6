"""``doctor --pack hf://OWNER/NAME[@REVISION]``: a pack judged on the Hub, read with range requests only, against
a stand-in Hub on loopback (tests/doctor/hub_server.py) serving synthetic packs whose data is never materialised.
"""

from __future__ import annotations

import os
import shlex
import struct
import sys
from collections import Counter

import pytest

from patch_dsv4.doctor.readers.base import DoctorContext, run_checks
from patch_dsv4.doctor.readers.hub import open_source
from patch_dsv4.doctor.run import _read_hub_pack, _register_checks, pack_checks
from patch_dsv4.output.errors import EnvironmentProblem
from tests.conftest import run_cli
from tests.doctor.hub_server import commit_of, serving
from tests.doctor.synthetic import build_mixedk_pack
from tests.doctor.synthetic_v41 import FLASH, SMALL41, build_v41_pack
from tests.errors import error_lines

REPO = "vcruz305/DeepSeek-V4.1-Flash-EXL3"
# What a Hub pack cannot be judged on as a local one is: links on a disk, the markers in the data, where it is.
HUB_ONLY = {"pack.symlinks", "experts.markers", "pack.source"}


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """huggingface_hub present, pointed at nothing but what the test serves: no token, no cache of the user's."""
    pytest.importorskip("huggingface_hub")
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return monkeypatch


@pytest.fixture(scope="module")
def full_v41(tmp_path_factory):
    """The full-size V4.1-Flash routed-only pack (48 shards, ~188k tensors, 19 MB of headers, 368 GB apparent)."""
    return build_v41_pack(tmp_path_factory.mktemp("full") / "pack", FLASH)


def headers_bytes(pack) -> int:
    total = 0
    for shard in pack.glob("*.safetensors"):
        with open(shard, "rb") as fh:
            total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total


def json_bytes(pack) -> int:
    return sum(p.stat().st_size for p in pack.glob("*.json"))


def judge(text: str) -> tuple[DoctorContext, dict]:
    """Every row doctor gives the pack ``text`` names (hf:// or a directory), by id, as run.doctor reads it."""
    source = open_source(text)
    ctx = DoctorContext(pack=source)
    _read_hub_pack(ctx)
    _register_checks()
    rows = run_checks(ctx, _source_checks() + pack_checks())
    return ctx, {row.id: row for row in rows}


def _source_checks():
    from patch_dsv4.doctor.readers.base import CHECKS

    return [spec for spec in CHECKS if spec.id == "pack.source"]


def local_rows(pack) -> dict:
    ctx = DoctorContext(pack=pack)
    return {row.id: row for row in run_checks(ctx, pack_checks())}


def test_a_full_size_v41_pack_on_the_hub_is_judged_as_on_disk_from_its_headers_alone(hub_env, full_v41):
    with serving({REPO: full_v41}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        ctx, rows = judge(f"hf://{REPO}")
    local = local_rows(full_v41)
    # The same verdicts as the downloaded pack's, row by row, besides what only a disk has.
    assert {i: (r.status, r.detail) for i, r in rows.items() if i not in HUB_ONLY} == {
        i: (r.status, r.detail.replace(str(full_v41), f"hf://{REPO}")) for i, r in local.items() if i not in HUB_ONLY
    }
    assert not [r for r in rows.values() if r.status == "fail"]
    source = ctx.source
    headers = headers_bytes(full_v41)
    # Headers only: at most twice their bytes plus the JSON files, and the data never sent beyond the overrun
    # of a guess at a header's length.
    assert source.header_bytes <= 2 * headers
    assert source.bytes_read <= 2 * headers + json_bytes(full_v41)
    assert hub.bytes_sent - hub.tree_bytes == source.bytes_read  # doctor's count is what the server sent
    assert hub.payload_bytes <= headers
    assert all(
        rng is not None for method, path, rng in hub.requests if method == "GET" and path.endswith(".safetensors")
    )
    info = rows["pack.source"]
    assert info.status == "info" and commit_of(REPO) in info.detail
    assert f"read {source.bytes_read:,} bytes" in info.detail and "no shard downloaded" in info.detail
    assert rows["experts.markers"].status == "skip" and "does not read from the Hub" in rows["experts.markers"].detail
    assert rows["pack.symlinks"].status == "skip"


def test_behind_a_cdn_every_header_is_asked_for_at_once_with_one_range_each(hub_env, full_v41):
    """The Hub answers a large file with a redirect to a CDN: the ranged GET is made there, its Range kept and
    the token left behind; the headers are asked for side by side, each with one range in the common case
    (its size from the index), and no more bytes than the headers and a few percent."""
    shards = sorted(p.name for p in full_v41.glob("*.safetensors"))
    with serving({REPO: full_v41}, cdn=True, delay=0.05, gather=16) as hub:
        hub.token = "hf_test_token"
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub_env.setenv("HF_TOKEN", hub.token)
        ctx, rows = judge(f"hf://{REPO}")
    local = local_rows(full_v41)
    assert {i: (r.status, r.detail) for i, r in rows.items() if i not in HUB_ONLY} == {
        i: (r.status, r.detail.replace(str(full_v41), f"hf://{REPO}")) for i, r in local.items() if i not in HUB_ONLY
    }
    at_cdn = [(path.rsplit("/", 1)[1], rng) for method, path, rng in hub.requests if path.startswith("/cdn/")]
    ranges = Counter(name for name, rng in at_cdn if name in shards)
    assert all(rng is not None for name, rng in at_cdn if name in shards)  # the Range went along
    assert set(ranges) == set(shards) and sum(n == 1 for n in ranges.values()) >= 0.8 * len(shards)
    assert max(ranges.values()) <= 2
    assert hub.cdn_authorization == 0  # the token stays with the Hub
    assert hub.most_in_flight >= 16  # side by side, not one after the other
    assert ctx.source.header_bytes <= 1.05 * headers_bytes(full_v41)
    assert hub.bytes_sent - hub.tree_bytes == ctx.source.bytes_read


def test_a_redirect_to_the_cdn_is_followed_with_its_range(hub_env, tmp_path):
    """Where a HEAD gives no link (a mirror answering it itself), the ranged GET goes to the Hub, whose 302 is
    followed to the CDN with the same Range."""
    pack = build_v41_pack(tmp_path / "pack", SMALL41)
    shards = sorted(p.name for p in pack.glob("*.safetensors"))
    with serving({REPO: pack}, cdn=True) as hub:
        hub.head_redirects = False
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        _, rows = judge(f"hf://{REPO}")
    assert rows["pack.shards"].status == "pass"
    gets = [(path.rsplit("/", 1)[1], path, rng) for method, path, rng in hub.requests if method == "GET"]
    asked, at_cdn = {}, {}
    for name, path, rng in gets:  # each shard's first range, asked of the Hub and then of the CDN
        (asked if "/resolve/" in path else at_cdn if path.startswith("/cdn/") else {}).setdefault(name, rng)
    assert all(asked[name] is not None and at_cdn[name] == asked[name] for name in shards)


def test_doctor_from_the_hub_as_a_user_runs_it(hub_env, make_tree, tmp_path):
    tree = make_tree("0.34.0")
    pack = build_v41_pack(tmp_path / "pack", SMALL41)
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        result = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}@main")
        as_json = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}@{commit_of(REPO)}", "--json")
    assert "Traceback" not in result.stderr
    assert f"hf://{REPO}@main" in result.stdout and commit_of(REPO) in result.stdout
    checks = {row["id"]: row for row in as_json.json()["checks"]}
    assert as_json.json()["pack"] == f"hf://{REPO}@{commit_of(REPO)}"
    assert checks["pack.source"]["status"] == "info" and "no shard downloaded" in checks["pack.source"]["detail"]
    assert checks["pack.shards"]["status"] == "pass"


def test_a_server_that_ignores_range_stops_doctor_before_it_reads_a_shard(hub_env, full_v41):
    with serving({REPO: full_v41}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.ignore_range = True
        source = open_source(f"hf://{REPO}")
        ctx = DoctorContext(pack=source)
        with pytest.raises(EnvironmentProblem) as raised:
            _read_hub_pack(ctx)
        shard = min(full_v41.glob("*.safetensors"))
    line = raised.value.line()
    assert "ignored the Range request for model-00001-of-00048.safetensors" in line and "\n" not in line
    assert "stopped before reading any of it" in line
    # the way on runs: the Hub itself (HF_ENDPOINT named this one), or the pack read from disk
    assert line.endswith(
        "(next: unset HF_ENDPOINT (the Hub answers range requests as asked; this endpoint does not), or hf download"
        f" {REPO} --local-dir DIR, then doctor --pack DIR)"
    ), line
    # Nothing of the shard's body was read by doctor (only the JSON files were); the connection was closed at
    # once, so the server got out only what the sockets' buffers took before it saw the hang-up.
    assert source.header_bytes == 0 and source.bytes_read == json_bytes(full_v41)
    assert hub.ignored_sent < shard.stat().st_size / 10


def test_the_cli_says_so_as_every_error_is_said(hub_env, make_tree, tmp_path):
    tree = make_tree("0.34.0")
    pack = build_mixedk_pack(tmp_path / "pack")
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.ignore_range = True
        result = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}")
    assert result.code == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("patch-dsv4: ") for line in lines) and result.stdout == ""
    assert "ignored the Range request" in " ".join(lines)


def test_a_wrong_content_range_stops_doctor(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.wrong_range = True
        with pytest.raises(EnvironmentProblem, match="not the range asked") as raised:
            judge(f"hf://{REPO}")
    assert raised.value.line().endswith("(next: unset HF_ENDPOINT (the Hub answers range requests as asked; this"
                                        " endpoint does not))")  # fmt: skip


def test_a_404_shard_and_a_truncated_answer_are_failures_with_reasons(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    shards = sorted(p.name for p in pack.glob("*.safetensors"))
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.missing = {shards[1]}
        hub.truncate = {shards[2]}
        ctx, rows = judge(f"hf://{REPO}")
    row = rows["pack.shards"]
    assert row.status == "fail"
    assert f"{shards[1]}: is not on the server at commit {commit_of(REPO)} (HTTP 404)" in row.detail
    assert "(and 1 more)" in row.detail
    assert "do not download this revision" in row.fix
    problems = [str(p) for p in ctx.cached("pack.scan", lambda: None).problems]
    assert len(problems) == 2 and problems[1].startswith(f"{shards[2]}: ") and "cut short" in problems[1]


def test_a_truncated_answer_names_the_shard_and_the_bytes_missing(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    first = min(p.name for p in pack.glob("*.safetensors"))
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.truncate = {first}
        _, rows = judge(f"hf://{REPO}")
    detail = rows["pack.shards"].detail
    assert rows["pack.shards"].status == "fail" and f"{first}: " in detail and "cut short" in detail


def _write_header_len(path, header_len: int) -> None:
    with open(path, "r+b") as fh:
        fh.write(struct.pack("<Q", header_len))


def test_a_header_length_beyond_the_file_or_past_the_hub_limit_fails_reading_only_the_first_bytes(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    first, second = sorted(pack.glob("*.safetensors"))[:2]
    _write_header_len(first, first.stat().st_size)  # 8 bytes past the end
    os.truncate(second, 40_000_000)  # sparse: 40 MB apparent
    _write_header_len(second, 30_000_000)  # within the file, past the Hub client's 25,000,000
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        ctx, rows = judge(f"hf://{REPO}")
    detail = rows["pack.shards"].detail
    assert rows["pack.shards"].status == "fail"
    assert f"{first.name}: header length {first.stat().st_size} runs past the end of the file" in detail
    problems = [str(p) for p in ctx.cached("pack.scan", lambda: None).problems]
    assert any(p.startswith(f"{second.name}: header length 30,000,000 is more than doctor reads") for p in problems)
    assert ctx.source.header_bytes < 2 * headers_bytes_of_others(pack, {first.name, second.name}) + (2 << 20)


def headers_bytes_of_others(pack, skip) -> int:
    total = 0
    for shard in pack.glob("*.safetensors"):
        if shard.name not in skip:
            with open(shard, "rb") as fh:
                total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total


def test_a_gated_pack_needs_hf_token(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub.token = "hf_test_token"
        with pytest.raises(EnvironmentProblem, match="gated.*HF_TOKEN") as refused:
            open_source(f"hf://{REPO}")
        # the way on is a command (a saved token is sent as HF_TOKEN is)
        assert "(next: hf auth login, with a token of an account that has accepted its terms" in refused.value.line()
        hub_env.setenv("HF_TOKEN", "hf_test_token")
        _, rows = judge(f"hf://{REPO}")
    assert rows["pack.shards"].status == "pass"


def test_an_unknown_repository_or_revision_is_one_line(hub_env, tmp_path):
    pack = build_mixedk_pack(tmp_path / "pack")
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(EnvironmentProblem, match="no such repository"):
            open_source("hf://nobody/nothing")
        with pytest.raises(EnvironmentProblem, match="no revision 'v9'"):
            open_source(f"hf://{REPO}@v9")
    with pytest.raises(EnvironmentProblem, match="hf://OWNER/NAME"):
        open_source("hf://only-a-name")


def test_an_endpoint_that_is_not_a_hub_stops_doctor(hub_env, tmp_path):
    with serving({}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint + "/nothing-here")
        with pytest.raises(EnvironmentProblem) as raised:
            open_source(f"hf://{REPO}")
    assert "\n" not in raised.value.line()


def test_without_huggingface_hub_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(EnvironmentProblem) as raised:
        open_source(f"hf://{REPO}")
    # into the interpreter that runs patch-dsv4, whichever pip is first on PATH
    assert f"{shlex.quote(sys.executable)} -m pip install 'patch-dsv4[hub]'" in raised.value.line()


def test_fix_config_on_a_hub_pack_prints_the_edits_and_writes_nothing(hub_env, make_tree, tmp_path):
    def fork_route(config: dict) -> None:
        config["quantization_config"]["non_routed_dtype_policy"] = "official_source_native"

    tree = make_tree("0.34.0")
    pack = build_mixedk_pack(tmp_path / "pack", edit_config=fork_route)
    before = {p.name: p.stat().st_mtime_ns for p in pack.iterdir()}
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        result = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}", "--fix-config")
        as_json = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}", "--fix-config", "--json")
    assert '+    "non_routed_dtype_policy": "bf16_as_stored",' in result.stdout
    assert "wrote nothing" in result.stderr and "is on the Hub" in result.stderr
    fix = as_json.json()["config_fix"]
    assert fix["written"] is False and fix["backup"] is None and "bf16_as_stored" in fix["diff"]
    assert {p.name: p.stat().st_mtime_ns for p in pack.iterdir()} == before


def test_fix_config_on_a_v41_hub_pack_prints_v41s_own_edits(hub_env, tmp_path):
    from patch_dsv4.doctor.fix_config import planned_fix

    pack = build_v41_pack(
        tmp_path / "pack", SMALL41, edit_config=lambda c: c["quantization_config"].update(quant_method="fp8")
    )
    before = (pack / "config.json").read_bytes()
    with serving({REPO: pack}) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        ctx, _ = judge(f"hf://{REPO}")
        result = planned_fix(ctx)
    assert result.written is False and result.refused is None
    assert '-    "quant_method": "fp8"' in result.diff and '+    "quant_method": "exl3"' in result.diff
    assert (pack / "config.json").read_bytes() == before


def test_an_empty_hf_endpoint_means_the_hub_and_a_bare_host_is_one_clear_line(hub_env, make_tree):
    """``HF_ENDPOINT=""`` (a script's ``HF_ENDPOINT=$MIRROR`` with no mirror) reads from the Hub, as if unset;
    ``HF_ENDPOINT=hf-mirror.com`` (no scheme) is said to be no URL. Offline, so nothing leaves the machine."""
    import subprocess

    tree = make_tree("0.34.0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT="", HF_HUB_OFFLINE="1", HF_HOME=os.environ["HF_HOME"])
    command = [sys.executable, "-m", "patch_dsv4", "doctor", "--site-packages", str(tree), "--pack", f"hf://{REPO}"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2 and line.startswith(
        f"patch-dsv4: error: cannot read hf://{REPO} from https://huggingface.co: HF_HUB_OFFLINE is set"
    )
    hub_env.setenv("HF_ENDPOINT", "hf-mirror.com")
    result = run_cli("doctor", "--site-packages", tree, "--pack", f"hf://{REPO}")
    (line,) = error_lines(result.stderr)
    assert result.code == 2 and line.startswith("patch-dsv4: error: HF_ENDPOINT='hf-mirror.com' is not a URL")
    assert line.endswith("(next: unset HF_ENDPOINT (doctor then reads the Hub itself; a mirror is named by its"
                         " http(s):// address))")  # fmt: skip
    assert "UnsupportedProtocol" not in result.stderr


def _doctor_on_a_terminal(tree, endpoint: str, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, what reached the terminal) of doctor in a fresh process whose stderr is a terminal
    (a pseudo-terminal this test reads) and whose stdout is a pipe."""
    import pty
    import subprocess
    import threading

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=os.environ["HF_HOME"], TERM="xterm", COLUMNS="80", NO_PROXY="127.0.0.1")
    master, slave = pty.openpty()
    command = [sys.executable, "-m", "patch_dsv4", "doctor", "--site-packages", str(tree), "--pack", f"hf://{REPO}"]
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end closed
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, stdout.decode(), seen.decode("utf-8", "replace")


def test_reading_from_the_hub_shows_progress_on_a_terminal_only(hub_env, make_tree, tmp_path):
    """On a terminal doctor shows what it has read (headers, requests, bytes) while it reads; nothing extra on
    a pipe or with -q."""
    import subprocess

    tree = make_tree("0.34.0")
    pack = build_v41_pack(tmp_path / "pack", SMALL41)
    with serving({REPO: pack}, cdn=True, delay=0.2) as hub:
        code, stdout, terminal = _doctor_on_a_terminal(tree, hub.endpoint)
        assert code == 1 and "pack.source" in stdout
        assert f"reading hf://{REPO}" in terminal and "headers," in terminal and " requests, " in terminal
        code, stdout, terminal = _doctor_on_a_terminal(tree, hub.endpoint, "-q")
        assert code == 1 and terminal == ""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=os.environ["HF_HOME"], NO_PROXY="127.0.0.1")
        command = [sys.executable, "-m", "patch_dsv4", "doctor", "--site-packages", str(tree)]
        piped = subprocess.run(
            [*command, "--pack", f"hf://{REPO}"], capture_output=True, text=True, env=env, timeout=120
        )
    assert piped.returncode == 1 and piped.stderr == ""
