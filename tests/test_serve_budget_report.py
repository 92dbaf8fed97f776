"""The budget sweep's merged record (benchmarks/serve_h200_budget.py): what it concludes from the steps' JSONs."""

from __future__ import annotations

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def report():
    return load_script("benchmarks/serve_h200_budget.py")


def _point(rate, ttft_p99, itl_p99, engine=None):
    median = {"completed": 10, "output_tok_s": 100.0, "ttft_ms": {"p50": 1.0, "p99": ttft_p99},
              "tpot_ms": {"p50": 5.0}, "itl_ms": {"p50": 5.0, "p99": itl_p99}, "goodput": {"request_goodput": 1.0}}
    if engine:
        median["engine"] = engine
    return {"load": "rate", "value": rate, "median": median}


def test_the_highest_rate_within_the_slo_is_the_last_of_an_unbroken_run(report):
    rep = {"configs": [{"points": [_point(4, 90, 30), _point(8, 99, 30), _point(16, 140, 49),
                                   _point(20, 350, 53), _point(24, 800, 39), _point("inf", 2000, 90)]}]}
    rows, best = report.poisson_rows(rep)
    assert [r["within_slo"] for r in rows] == [True, True, True, False, True, False]
    assert best == 16  # 24 passed, but above a rate that missed: noise, not capacity
    assert report.poisson_rows({"configs": [{"points": [_point(4, 1200, 30)]}]})[1] is None


def test_served_rows_carry_the_engines_own_account_beside_the_offline_engine(report):
    offline = {"default_budget": "2048", "results": [
        {"budget": "2048", "output_tok_s": 4000.0, "itl_ms": {"p50": 7.0, "p99": 50.0, "max": 55.0},
         "ttft_ms": {"p99": 1600.0}, "decode_step_ms_median": 7.0, "steps": {"mixed": 29},
         "mixed_step_ms_median": 50.0}]}
    served_point = _point(0, 1600, 55, engine={"busy_fraction": 0.99, "mixed_steps": 104,
                                               "mixed_step_ms_mean": 50.0, "decode_step_ms_mean": 6.8})
    served_point.update(load="concurrency", value=64)
    served_point["median"]["tpot_ms"]["p50"] = 11.0
    served_point["median"]["ttft_ms"]["p50"] = 400.0
    served_point["median"]["output_tok_s"] = 3800.0
    served = {"configs": [{"label": "default", "points": [served_point]}]}
    (row,) = report.budget_rows(offline, served, 64)
    assert row["budget"].startswith("2048") and row["out_vs_offline"] == 0.95
    assert (row["served_engine_busy"], row["served_mixed_steps"], row["served_mixed_step_ms"]) == (0.99, 104, 50.0)


def test_the_offline_engines_pieces_cover_every_fixed_budget_of_the_sweep_the_default_included(report):
    # "512,default" once sized the pieces to 512: the default's 1024-token mixed steps then ran eagerly
    assert report.pieces_max_tokens("512,default", 64, "cuda") == 1024
    assert report.pieces_max_tokens("default,2048,512", 64, "cuda") == 2048
    assert report.pieces_max_tokens("default", 1024, "cuda") == 2048  # max(1024, 2 x --max-running-requests)
    assert report.pieces_max_tokens("auto,off", 64, "cuda") == 2048  # nothing fixed: the engine's own 2048
