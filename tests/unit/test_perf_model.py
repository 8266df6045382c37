"""Exact values of the performance model (docs/architecture.md)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.perf_model import (
    estimate_alpha,
    expected_tokens,
    optimal_gamma_sync,
    speedup_pipelined,
    speedup_sync,
    verify_cost,
)


def test_expected_tokens_exact():
    assert expected_tokens(0.5, 3) == 1.875  # 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens(0.8, 1) == pytest.approx(1.8)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.7, 0) == 1.0
    assert expected_tokens(1 - 1e-12, 4) == pytest.approx(5.0, rel=1e-10)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(alpha=st.floats(0.0, 1.0), gamma=st.integers(0, 16))
def test_expected_tokens_is_the_geometric_series(alpha, gamma):
    series = math.fsum(alpha**i for i in range(gamma + 1))
    assert expected_tokens(alpha, gamma) == pytest.approx(series, rel=1e-9)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="gamma"):
        speedup_sync(0.5, -1, 0.1, 1.0, 0.0)
    with pytest.raises(ValueError):
        estimate_alpha(-1, 0)


def test_speedup_sync_exact():
    # E = 1.875, denominator 3·0.1 + 1.2 + 0.1 = 1.6
    assert speedup_sync(0.5, 3, c=0.1, v=1.2, rho=0.1) == pytest.approx(1.875 / 1.6)
    # γ = 0: plain decoding, one target step plus overhead; v is ignored
    assert speedup_sync(0.9, 0, c=0.1, v=7.0, rho=0.25) == pytest.approx(0.8)
    assert speedup_sync(0.9, 0, c=0.1, v=1.0, rho=0.0) == 1.0


def test_speedup_sync_below_one_for_a_bad_draft():
    assert speedup_sync(0.8, 4, c=1.0, v=1.0, rho=0.05) < 1.0  # draft as slow as the target
    assert speedup_sync(0.1, 4, c=0.05, v=1.0, rho=0.05) < 1.0  # poor acceptance
    assert speedup_sync(0.8, 4, c=0.05, v=1.0, rho=0.05) > 1.0


def test_verify_cost_convention():
    assert verify_cost(0, 0.3) == 1.0
    assert verify_cost(4, 0.25) == 2.0
    assert verify_cost(4) == 1.0


def test_speedup_pipelined_exact():
    alpha, gamma = 0.5, 3
    a_leg, b_leg = 3 * 0.2 + 0.1, 1.0 + 0.1  # A = 0.7, B = 1.1
    p_all = 0.125
    expected = 1.875 / (p_all * max(a_leg, b_leg) + (1 - p_all) * (a_leg + b_leg))
    got = speedup_pipelined(alpha, gamma, c=0.2, v=1.0, rho_d=0.1, rho_v=0.1)
    assert got == pytest.approx(expected)
    assert speedup_pipelined(0.9, 0, c=0.2, v=3.0, rho_d=0.5, rho_v=0.25) == pytest.approx(0.8)


@settings(derandomize=True, max_examples=100, deadline=None)
@given(
    alpha=st.floats(0.0, 1.0),
    gamma=st.integers(1, 12),
    c=st.floats(0.0, 2.0),
    v=st.floats(1.0, 4.0),
    rho_d=st.floats(0.0, 1.0),
    rho_v=st.floats(0.0, 1.0),
)
def test_pipelining_never_loses_and_equals_sync_at_alpha_zero(alpha, gamma, c, v, rho_d, rho_v):
    sync = speedup_sync(alpha, gamma, c, v, rho_d + rho_v)
    pipelined = speedup_pipelined(alpha, gamma, c, v, rho_d, rho_v)
    assert pipelined >= sync * (1 - 1e-12)
    assert speedup_pipelined(0.0, gamma, c, v, rho_d, rho_v) == pytest.approx(
        speedup_sync(0.0, gamma, c, v, rho_d + rho_v)
    )


def test_pipelining_hides_the_shorter_leg_at_alpha_one():
    # all accepted: round = max(A, B) = max(4·0.1 + 0, 1 + 0) = 1, E = 5
    assert speedup_pipelined(1.0, 4, c=0.1, v=1.0, rho_d=0.0, rho_v=0.0) == 5.0


def test_estimate_alpha():
    assert estimate_alpha(6, 2) == 0.75
    assert estimate_alpha(10, 0) == 1.0
    assert estimate_alpha(0, 7) == 0.0
    assert estimate_alpha(0, 0) == 0.0
    assert estimate_alpha(0, 0, default=0.6) == 0.6


def test_optimal_gamma_sync():
    assert optimal_gamma_sync(0.05, c=0.5, rho=0.1, max_gamma=8) == 0
    assert optimal_gamma_sync(0.95, c=0.01, rho=0.1, max_gamma=8) == 8
    flat = optimal_gamma_sync(0.8, c=0.05, rho=0.1, max_gamma=8)
    steep = optimal_gamma_sync(0.8, c=0.05, rho=0.1, max_gamma=8, marginal_verify=0.5)
    assert steep < flat
