"""Helpers for the doctor pack tests: build a synthetic pack, run the pack checks on it."""

from __future__ import annotations

import pytest

from patcher.doctor import pack as pack_checks
from patcher.doctor.base import CHECKS, FAIL, DoctorContext, Row, run_checks
from tests.doctor.synthetic import build_lna_dense_pack, build_mixedk_pack, fake_vllm

PACK_CHECKS = [spec for spec in CHECKS if spec.fn.__module__ == pack_checks.__name__]
DSPARK = """--speculative-config '{"method": "dspark", "num_speculative_tokens": 3}'"""


def run_pack_checks(pack, serve_args: str = "", runtime=None) -> dict[str, Row]:
    """Every pack row by id; no row may be an internal error (a check that raised)."""
    ctx = DoctorContext.from_serve_args(serve_args, pack=pack, runtime=runtime)
    rows = run_checks(ctx, PACK_CHECKS)
    assert [r.id for r in rows] == [spec.id for spec in PACK_CHECKS]
    crashed = [r for r in rows if r.status == FAIL and r.detail.startswith("internal error")]
    assert not crashed, crashed
    return {row.id: row for row in rows}


@pytest.fixture
def mixedk(tmp_path):
    """``mixedk(**hooks)``: a small vcruz305 MixedK vision pack under tmp_path."""
    return lambda **hooks: build_mixedk_pack(tmp_path / "mixedk", **hooks)


@pytest.fixture
def lna(tmp_path):
    """``lna(**hooks)``: a small lna-lab Dense pack under tmp_path."""
    return lambda **hooks: build_lna_dense_pack(tmp_path / "lna", **hooks)


@pytest.fixture
def stock_vllm(tmp_path):
    return fake_vllm(tmp_path / "site-stock")


@pytest.fixture
def lna_vllm(tmp_path):
    return fake_vllm(tmp_path / "site-lna", lna_dense=True)
