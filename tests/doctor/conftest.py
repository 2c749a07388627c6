"""Fixtures for the doctor pack tests: small synthetic packs and vLLM trees under tmp_path."""

from __future__ import annotations

import pytest

from tests.doctor.synthetic import build_lna_dense_pack, build_mixedk_pack, fake_vllm


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
