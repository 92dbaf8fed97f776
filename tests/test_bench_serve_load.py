"""bench serve open-loop arrivals (Poisson and gamma bursts) and goodput under SLOs, on constructed data."""

import numpy as np
import pytest
from test_bench_serve_metrics import _result

from attnserve.bench.serve.load import arrival_gaps
from attnserve.bench.serve.metrics import aggregate_seeds, meets, parse_goodput, summarize
from attnserve.bench.serve.plan import server_configs


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    gaps = np.array(arrival_gaps(np.random.default_rng(7), rate=8.0, burstiness=1.0, num=20_000))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)  # rate 8/s: the standard error is 0.7 %
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    # arrivals counted in 1 s windows are Poisson: variance equals the mean
    counts = np.bincount(np.cumsum(gaps).astype(int))[:-1]
    assert counts.mean() == pytest.approx(8.0, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)
    assert arrival_gaps(np.random.default_rng(7), 8.0, 1.0, 5) == gaps[:5].tolist()  # a seed replays


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_changes_the_spread(burstiness):
    gaps = np.array(arrival_gaps(np.random.default_rng(3), rate=4.0, burstiness=burstiness, num=20_000))
    assert gaps.mean() == pytest.approx(1 / 4, rel=0.05)
    # gamma with shape b: coefficient of variation 1 / sqrt(b)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.06)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_gaps(np.random.default_rng(0), float("inf"), 1.0, 3) == [0.0, 0.0, 0.0]


def test_goodput_counts_completed_requests_within_every_objective():
    slo = parse_goodput(["ttft:500", "tpot:100", "e2el:1000"])
    assert slo == {"ttft": 500.0, "tpot": 100.0, "e2el": 1000.0}
    good = _result(0.2, [0.09, 0.09], 3)  # TTFT 200 ms, TPOT 90 ms, E2E 380 ms: meets all
    slow_first = _result(0.6, [0.05], 2)  # TTFT 600 ms
    slow_tokens = _result(0.1, [0.15, 0.15], 3)  # TPOT 150 ms
    long_total = _result(0.4, [0.09] * 8, 9)  # TTFT 400, TPOT 90, but E2E 1120 ms
    one_token = _result(0.3, [], 1)  # no TPOT: meets the TPOT objective
    failed = _result(0.1, [0.01], 2, error="HTTP 500: x")
    cut = _result(0.1, [0.01], 2, cut=True)
    results = [good, slow_first, slow_tokens, long_total, one_token, failed, cut]
    assert [meets(r, slo) for r in results] == [True, False, False, False, True, False, False]
    s = summarize(results, duration_s=4.0, slo=slo)
    assert s["goodput"] == {"request_goodput": 0.5, "good_requests": 2, "good_fraction": 0.4}
    assert summarize(results, 4.0, {"ttft": 250.0})["goodput"]["good_requests"] == 2  # good, slow_tokens
    assert "goodput" not in summarize(results, 4.0)
    median, _ = aggregate_seeds([s, summarize(results, 2.0, slo)])
    assert median["goodput"]["request_goodput"] == 0.75  # median of 0.5 and 1.0


@pytest.mark.parametrize("items", [["ttft=500"], ["latency:5"], ["tpot:-1"], ["tpot:x"]])
def test_goodput_refuses_a_bad_objective_by_name(items):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(items)


def test_compare_spec_shorthand_turns_speculation_on_with_one_flag():
    cfgs = server_configs(None, "--model m", None, ["base=", "spec=ngram", "spec=--speculative-algorithm eagle"])
    assert [(c.label, c.flags) for c in cfgs] == [
        ("base", "--model m"),
        ("spec-ngram", "--model m --speculative-algorithm ngram"),
        ("spec", "--model m --speculative-algorithm eagle"),
    ]
