"""bench serve arithmetic: percentiles, per-request TPOT/ITL, seed aggregation, the sweep plan's checks."""

import pytest

from attnserve.bench.serve.client import RequestResult
from attnserve.bench.serve.metrics import aggregate_seeds, distribution, summarize
from attnserve.bench.serve.plan import load_points, server_configs


def test_percentiles_match_hand_computed_values():
    # 1..10 seconds; linear interpolation at rank q/100 * (n - 1):
    # p50 -> rank 4.5 -> 5.5 s; p90 -> rank 8.1 -> 9.1 s; p99 -> rank 8.91 -> 9.91 s; mean 5.5 s
    d = distribution([float(x) for x in range(10, 0, -1)])
    assert d == {"mean": 5500.0, "p50": 5500.0, "p90": 9100.0, "p99": 9910.0}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert distribution([0.002])["p99"] == 2.0


def _result(ttft, chunk_gaps, tokens, error=None, cut=False):
    r = RequestResult(prompt_len=10, output_len_asked=tokens, start=100.0, ttft_s=ttft, error=error, cut=cut)
    t = r.start + ttft
    r.chunk_times = [t]
    for g in chunk_gaps:
        t += g
        r.chunk_times.append(t)
    r.e2e_s = t - r.start
    r.output_tokens = tokens
    r.usage_reported = True
    return r


def test_summary_counts_tpot_itl_and_errors():
    ok_a = _result(0.5, [0.1, 0.1, 0.2], 4)  # TPOT = (0.9 - 0.5) / 3
    ok_b = _result(1.0, [0.3], 2)  # TPOT = 0.3
    failed = _result(0.2, [], 1, error="HTTP 500: boom")
    cut = _result(0.4, [0.05], 2, cut=True)
    s = summarize([ok_a, ok_b, failed, cut], duration_s=2.0)
    assert (s["requests_sent"], s["completed"], s["failed"], s["cut_by_time_budget"]) == (4, 2, 1, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["request_throughput"] == 1.0
    assert s["output_tok_s"] == (4 + 2 + 2) / 2.0  # completed + what the cut request streamed
    assert s["input_tok_s"] == 3 * 10 / 2.0
    assert s["tpot_ms"]["mean"] == pytest.approx(1e3 * ((0.4 / 3) + 0.3) / 2, abs=1e-3)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # gaps 0.1, 0.1, 0.2, 0.3, 0.05
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(1e3 * (0.5 + 1.0 + 0.4) / 3, abs=1e-3)
    assert s["e2e_ms"]["p50"] == pytest.approx(1e3 * (0.9 + 1.3) / 2, abs=1e-3)


def test_seed_aggregate_sums_counts_and_takes_medians():
    seeds = [summarize([_result(t, [0.1], 2)], 1.0) for t in (0.1, 0.3, 0.2)]
    seeds[1]["failed"], seeds[1]["errors"] = 2, {"HTTP 500: x": 2}
    median, spread = aggregate_seeds(seeds)
    assert median["completed"] == 3 and median["failed"] == 2 and median["errors"] == {"HTTP 500: x": 2}
    assert median["ttft_ms"]["p50"] == 200.0
    assert spread["ttft_ms"]["p50"] == [100.0, 300.0]


def test_plan_points_seeds_and_prompt_counts():
    pts = load_points("1,8", "2.5,inf", "3,3,1,1", 5, "40")
    assert [(p.load.kind, p.load.value, p.seeds, p.num_prompts) for p in pts] == [
        ("concurrency", 1, (5, 6, 7), 40),
        ("concurrency", 8, (5, 6, 7), 40),
        ("rate", 2.5, (5,), 40),
        ("rate", float("inf"), (5,), 40),
    ]
    assert [p.num_prompts for p in load_points("2,8", "3", "1", 0, "2x")] == [4, 16, 6]
    assert [p.num_prompts for p in load_points("1,8,64", None, "1", 0, "2x,1x,100")] == [2, 8, 100]


@pytest.mark.parametrize(
    "args, message",
    [
        (("0,8", None, "1", 0, "8"), "--concurrency '0,8'"),
        (("1", "fast", "1", 0, "8"), "--request-rate 'fast'"),
        (("1,2", None, "3,1,1", 0, "8"), "3 counts for 2 load points"),
        (("1", None, "1", 0, "many"), "--num-prompts 'many'"),
        (("1,2", None, "1", 0, "4,4,4"), "3 values for 2 load points"),
        ((None, "inf", "1", 0, "2x"), "give a plain count"),
    ],
)
def test_plan_refuses_bad_values_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        load_points(*args)


def test_configs_from_backends_compare_and_urls():
    cfgs = server_configs(None, "--model m --page-size 16", "triton,flashinfer", None)
    assert [(c.label, c.flags) for c in cfgs] == [
        ("triton", "--model m --page-size 16 --attention-backend triton"),
        ("flashinfer", "--model m --page-size 16 --attention-backend flashinfer"),
    ]
    cfgs = server_configs(["peer=http://h:1/"], None, None, ["fi=--decode-attention-backend flashinfer", ""])
    assert [(c.label, c.url, c.flags) for c in cfgs] == [
        ("peer", "http://h:1", None),
        ("fi", None, "--decode-attention-backend flashinfer"),
        ("default", None, ""),
    ]
    with pytest.raises(ValueError, match="no server"):
        server_configs(None, None, None, None)
    with pytest.raises(ValueError, match="--url 'localhost:1'"):
        server_configs(["localhost:1"], None, None, None)
    with pytest.raises(ValueError, match="repeats"):
        server_configs(None, "", None, ["--x", "--x"])


def test_report_without_matplotlib_still_writes_json_and_markdown(tmp_path, monkeypatch):
    import sys

    from attnserve.bench.serve.report import write_all

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the [bench] extra is not installed
    report = {"title": "t", "configs": [{"label": "x", "error": "boom\nlast line", "points": []}]}
    notes = write_all(report, tmp_path / "r.json")
    assert notes and "pip install 'attnserve[bench]'" in notes[0]
    assert (tmp_path / "r.json").is_file() and not (tmp_path / "r.png").exists()
    assert "| x | - | did not run: last line |" in (tmp_path / "r.md").read_text()


def test_engine_activity_is_the_difference_of_two_server_info_reads():
    from attnserve.bench.serve.metrics import engine_activity

    before = {"engine_steps": {"by_mode": {"decode": 10, "extend": 2}, "seconds_by_mode": {"decode": 0.1, "extend": 0.2}}}
    after = {"engine_steps": {"by_mode": {"decode": 110, "extend": 2, "mixed": 4},
                              "seconds_by_mode": {"decode": 0.9, "extend": 0.2, "mixed": 0.4}}}
    e = engine_activity(before, after, duration_s=2.0)
    assert (e["decode_steps"], e["mixed_steps"], e["extend_steps"]) == (100, 4, 0)
    assert e["decode_step_ms_mean"] == 8.0 and e["mixed_step_ms_mean"] == 100.0 and e["extend_step_ms_mean"] is None
    assert e["busy_s"] == 1.2 and e["busy_fraction"] == 0.6
    # a peer's /server_info (or none at all) has no engine_steps: nothing is made up
    assert engine_activity({"kv_cache": {}}, {"kv_cache": {}}, 2.0) is None
    assert engine_activity(None, after, 2.0) is None
