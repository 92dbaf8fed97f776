"""bench serve against a fake server that fails on purpose: failures are counted and named, never crashes."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest
from serve_fake_server import FakeServer

from attnserve.bench.serve.client import RequestSpec
from attnserve.bench.serve.datasets import BenchRequest
from attnserve.bench.serve.load import LoadPoint, run_point
from attnserve.bench.serve.synthetic import write_tokenizer_dir
from attnserve.cli import main


def bench(args: str) -> int:
    """`attnserve bench serve ARGS` in this process (paths here have no spaces)."""
    return main(["bench", "serve", *args.split()])


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    write_tokenizer_dir(path, vocab_size=500)
    return path


def _reqs(n, out_len=6):
    return [BenchRequest(" ".join(f"w{j + 3}" for j in range(i + 2)), i + 2, out_len) for i in range(n)]


def test_500s_dropped_streams_and_stream_errors_are_failed_requests():
    # request order n: 500 on n % 3 == 0, cut mid-stream on n % 4 == 0, error chunk on n % 5 == 0
    with FakeServer(fail_every=3, drop_every=4, error_every=5) as srv:
        spec = RequestSpec(srv.url, "fake-model")
        results, _ = asyncio.run(run_point(spec, _reqs(12), LoadPoint("concurrency", 1), seed=0))
    errors = [r.error for r in results]
    assert errors[2].startswith("HTTP 500: injected failure 3")
    assert all(errors[i].startswith("HTTP 500") for i in (5, 8, 11))
    assert errors[3] is not None and errors[7] is not None  # dropped connections (4, 8)
    assert errors[4] == "error in stream: injected engine error"  # 5 and 10
    assert errors[9] == "error in stream: injected engine error"
    ok = [i + 1 for i, e in enumerate(errors) if e is None]
    assert ok == [1, 2, 7, 11]
    assert all(results[i - 1].output_tokens == 6 and len(results[i - 1].itl_s) == 5 for i in ok)


@pytest.mark.parametrize("finish_reason, usage, ok", [(True, False, True), (False, True, False)])
def test_stream_without_done_marker_counts_only_after_a_finish_reason(finish_reason, usage, ok):
    # transformers serve ends with a finish_reason chunk and no [DONE]; a bare end of body is a failure
    with FakeServer(done_marker=False, finish_reason=finish_reason, usage=usage) as srv:
        results, _ = asyncio.run(
            run_point(RequestSpec(srv.url, None), _reqs(2), LoadPoint("concurrency", 1), seed=0)
        )
    assert [r.ok for r in results] == [ok, ok]
    if ok:  # no usage chunk: tokens are counted as chunks with text
        assert [r.output_tokens for r in results] == [6, 6] and not results[0].usage_reported
    else:
        assert results[0].error.startswith("stream ended before data: [DONE]")


def test_closed_loop_keeps_n_in_flight_and_sends_every_field():
    with FakeServer(token_delay_s=0.002) as srv:
        spec = RequestSpec(srv.url, "fake-model", extra_body={"top_k": 5})
        results, duration = asyncio.run(
            run_point(spec, _reqs(8, out_len=4), LoadPoint("concurrency", 4), seed=0)
        )
        bodies = srv.bodies
    assert len(results) == 8 and all(r.ok for r in results)
    b = bodies[0]
    assert b["stream"] is True and b["ignore_eos"] is True and b["max_tokens"] == 4 and b["top_k"] == 5
    assert b["stream_options"] == {"include_usage": True} and b["model"] == "fake-model"
    assert sorted(x["prompt"] for x in bodies) == sorted(r.prompt for r in _reqs(8))


def test_time_budget_cuts_in_flight_requests_without_calling_them_failures():
    with FakeServer(token_delay_s=0.05) as srv:
        spec = RequestSpec(srv.url, "fake-model")
        results, duration = asyncio.run(
            run_point(spec, _reqs(6, out_len=200), LoadPoint("rate", float("inf")), seed=0, max_seconds=0.5)
        )
    assert len(results) == 6 and all(r.cut and r.error is None for r in results)
    assert all(0 < r.output_tokens < 200 for r in results)


def test_cli_sweep_against_url_writes_json_markdown_png(tmp_path, word_tokenizer_dir, capsys):
    out = tmp_path / "res.json"
    # tokens 10 ms apart: far above a loaded host's scheduling jitter, so the client times each chunk alone
    with FakeServer(fail_every=4, token_delay_s=0.01) as srv:
        rc = bench(f"--url fake={srv.url} --tokenizer {word_tokenizer_dir} --input-len 12 --output-len 5 "
                   f"--concurrency 1,2 --request-rate 50 --num-prompts 4 --seeds 2,1,1 --warmup-requests 1 "
                   f"--json {out} --no-progress --note a-note")
        prompts = [b["prompt"] for b in srv.bodies]
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("attnserve bench serve --url fake=")
    assert rep["notes"] == ["a-note"] and rep["gpu"] and rep["date"]
    (cfg,) = rep["configs"]
    assert cfg["label"] == "fake" and cfg["attention_backend"] == {"prefill": "fake", "decode": "fake"}
    assert cfg["model"] == "fake-model" and cfg["server_info"]["versions"] == {"fake": "1"}
    assert [(p["load"], p["value"], p["seeds"]) for p in cfg["points"]] == [
        ("concurrency", 1, [0, 1]), ("concurrency", 2, [0]), ("rate", 50, [0])]
    total_failed = sum(p["median"]["failed"] for p in cfg["points"])
    total_ok = sum(p["median"]["completed"] for p in cfg["points"])
    assert total_ok + total_failed == 16 and total_failed == 4  # 17 with the warm-up; every 4th fails
    for p in cfg["points"]:
        m = p["median"]
        for key in ("request_throughput", "input_tok_s", "output_tok_s", "duration_s"):
            assert m[key] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(m[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 <= m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"]
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):  # each spans at least one whole read: never 0
            assert m[key]["p50"] > 0
        # ITL is the gap between two reads' arrival times: 0 for chunks one read returns together, which a
        # client descheduled for longer than the spacing does; that every gap is 0 would take stalls of
        # 10 ms at every token
        assert m["itl_ms"]["mean"] > 0
        assert all(e.startswith("HTTP 500") for e in m["errors"])
    assert all(len(p.split()) == 12 for p in prompts)  # exact token counts in the word vocabulary
    md = out.with_suffix(".md").read_text()
    assert "| fake | fake | c=1 | 2 |" in md and "Failed requests:" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| fake |" in capsys.readouterr().out


def test_cli_refuses_a_server_that_is_not_there(tmp_path, word_tokenizer_dir):
    rc = bench(f"--url http://127.0.0.1:9 --tokenizer {word_tokenizer_dir} --input-len 4 --output-len 2 "
               f"--concurrency 1 --num-prompts 2 --warmup-requests 0 --no-progress --json {tmp_path}/r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    m = rep["configs"][0]["points"][0]["median"]
    assert rc == 0 and m["failed"] == 2 and m["completed"] == 0
    assert all("ClientConnectorError" in e or "Connect" in e for e in m["errors"])


def test_sigterm_keeps_the_points_already_measured(tmp_path, word_tokenizer_dir):
    out = tmp_path / "int.json"
    with FakeServer() as srv:
        args = (f"--url {srv.url} --tokenizer {word_tokenizer_dir} --input-len 4 --output-len 3 "
                "--concurrency 1 --request-rate 0.05 --num-prompts 2 --warmup-requests 0 --no-progress "
                f"--json {out}")
        proc = subprocess.Popen([sys.executable, "-m", "attnserve", "bench", "serve", *args.split()],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for line in proc.stderr:  # the closed-loop point is done; the open loop now waits ~20 s per arrival
            if "=> " in line and "concurrency 1:" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 130
    (cfg,) = json.loads(out.read_text())["configs"]
    assert cfg["error"] == "interrupted after 1 of 2 load points"
    assert [p["median"]["completed"] for p in cfg["points"]] == [2]


def test_cli_jsonl_dataset_sends_the_file_prompts_and_lengths(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w9", "output_len": i + 1}) + "\n" for i in range(3)))
    with FakeServer() as srv:
        rc = bench(f"--url {srv.url} --dataset jsonl --dataset-path {data} --concurrency 2 --num-prompts 3 "
                   f"--warmup-requests 0 --no-progress --json {tmp_path / 'j.json'}")
        sent = sorted((b["prompt"], b["max_tokens"]) for b in srv.bodies)
    assert rc == 0 and sent == [("w0 w9", 1), ("w1 w9", 2), ("w2 w9", 3)]
    (point,) = json.loads((tmp_path / "j.json").read_text())["configs"][0]["points"]
    assert point["median"]["completed"] == 3
    assert point["median"]["input_tok_s"] > 0  # prompt tokens from the server's usage


@pytest.mark.parametrize("warmup", [0, 3])
def test_warmup_requests_are_sent_first_and_never_counted(tmp_path, word_tokenizer_dir, warmup):
    # the first 3 requests a server sees answer differently (one token): only a warm-up of 3 hides them
    out = tmp_path / "w.json"
    with FakeServer(cold_requests=3) as srv:
        rc = bench(f"--url {srv.url} --tokenizer {word_tokenizer_dir} --input-len 4 --output-len 5 "
                   f"--concurrency 2 --num-prompts 6 --warmup-requests {warmup} --no-progress --json {out}")
        sent = len(srv.bodies)
    assert rc == 0 and sent == 6 + warmup
    (cfg,) = json.loads(out.read_text())["configs"]
    m = cfg["points"][0]["median"]
    assert cfg["warmup"] == {"requests": warmup, "failed": 0}
    assert m["requests_sent"] == m["completed"] == 6
    assert (m["output_tokens_mean"] == 5) == (warmup == 3)


def test_cli_open_loop_goodput_and_synthetic_datasets(tmp_path, word_tokenizer_dir):
    out = tmp_path / "g.json"
    with FakeServer(fail_every=5) as srv:
        rc = bench(f"--url {srv.url} --tokenizer {word_tokenizer_dir} --dataset-name generated-shared-prefix "
                   "--gsp-num-groups 2 --gsp-system-prompt-len 8 --gsp-question-len 2 --output-len 3 "
                   "--request-rate 200,inf --burstiness 0.5 --num-prompts 10 --warmup-requests 0 "
                   f"--goodput ttft:60000 e2el:60000 --no-progress --json {out}")
        prompts = [b["prompt"] for b in srv.bodies]
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["dataset"]["name"] == "generated-shared-prefix" and rep["dataset"]["sp_groups"] == 2
    assert rep["load"]["burstiness"] == 0.5 and rep["load"]["goodput_slo_ms"] == {"ttft": 60000, "e2el": 60000}
    assert len({p.split("\n")[0] for p in prompts}) == 2  # two system prompts shared by all questions
    for p in rep["configs"][0]["points"]:
        m = p["median"]
        # generous objectives: every completed request is good, the failed ones are not
        assert m["goodput"]["good_requests"] == m["completed"] == 8 and m["failed"] == 2
    md = out.with_suffix(".md").read_text()
    assert "goodput req/s (met SLO)" in md and "ttft <= 60000 ms" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    with FakeServer() as srv:
        rc = bench(f"--url {srv.url} --tokenizer {word_tokenizer_dir} --dataset-name sharegpt-synthetic "
                   f"--request-rate inf --num-prompts 3 --warmup-requests 0 --no-progress --json {out}")
        asked = [b["max_tokens"] for b in srv.bodies]
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["dataset"]["lognormal_sigma"] == 1.0
    assert rep["configs"][0]["points"][0]["median"]["completed"] == 3 and len(set(asked)) > 1
