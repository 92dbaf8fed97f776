"""bench serve against the real `attnserve serve` on the embedded model (CPU): launched, and by --url."""

import json

import pytest

from attnserve.bench.serve.launch import LaunchedServer
from attnserve.cli import main

SMALL = "--input-len 16 --output-len 4 --concurrency 1,4 --num-prompts 4 --warmup-requests 1 --no-progress"
SMALL = SMALL.split()
FLAGS = "--device cpu --max-running-requests 4"
POINT_FIELDS = set(
    "requests_sent completed failed cut_by_time_budget errors duration_s request_throughput input_tok_s "
    "output_tok_s total_tok_s output_tokens_mean usage_reported cached_prompt_fraction "
    "ttft_ms tpot_ms itl_ms e2e_ms engine".split())


def _check_report(rep: dict, label: str) -> dict:
    assert {"title", "command", "date", "gpu", "client_versions", "dataset", "load", "configs"} <= set(rep)
    (cfg,) = rep["configs"]
    assert cfg["label"] == label and cfg["error"] is None
    backends = cfg["attention_backend"]
    assert backends["prefill"] and backends["decode"]  # read from /server_info
    assert cfg["server_info"]["kv_cache"] and cfg["server_info"]["versions"]
    assert [(p["load"], p["value"]) for p in cfg["points"]] == [("concurrency", 1), ("concurrency", 4)]
    for p in cfg["points"]:
        m = p["median"]
        assert set(m) == POINT_FIELDS
        assert (m["completed"], m["failed"], m["cut_by_time_budget"]) == (4, 0, 0) and m["errors"] == {}
        assert m["usage_reported"] and m["output_tokens_mean"] == 4  # ignore_eos: exact output lengths
        assert m["output_tok_s"] > 0 and m["input_tok_s"] > 0
        # the engine's own account of the point (read from /server_info before and after): 4 tokens a request
        # take at least 4 steps (a prompt the radix cache already holds but for its last token is a decode row,
        # so the second point may run no prefill at all); the steps' wall time lies inside the point's
        e = p["per_seed"][0]["engine"]
        assert e["decode_steps"] >= 3 and e["decode_steps"] + e["extend_steps"] + e["mixed_steps"] >= 4
        assert 0 < e["busy_s"] <= m["duration_s"] and 0 < e["busy_fraction"] <= 1
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(m[key]) == {"mean", "p50", "p90", "p99"}
            assert m[key]["p50"] > 0 or key == "itl_ms"  # chunks read together have no gap between them
            assert m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"]
    return cfg


@pytest.mark.needs_embedded_model
def test_launch_sweep_on_embedded_model(tmp_path):
    out = tmp_path / "launch.json"
    rc = main(["bench", "serve", "--launch", FLAGS, *SMALL, "--server-log-dir", str(tmp_path / "logs"),
               "--json", str(out)])
    assert rc == 0
    cfg = _check_report(json.loads(out.read_text()), FLAGS)
    assert cfg["server_command"] == f"attnserve serve {FLAGS}"
    assert cfg["server_exit_code"] == 0  # SIGTERM: graceful shutdown
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()


@pytest.mark.needs_embedded_model
def test_url_sweep_against_a_running_server(tmp_path):
    out, shared = tmp_path / "url.json", tmp_path / "shared.json"
    with LaunchedServer(FLAGS, tmp_path / "server.log", timeout_s=300) as srv:
        rc = main(["bench", "serve", "--url", f"ours={srv.url}", *SMALL, "--json", str(out)])
        # one system prompt of 64 tokens shared by 3 questions: after the first, the radix cache serves it
        sp = "--dataset shared-prefix --sp-groups 1 --sp-system-len 64 --sp-question-len 4 --output-len 2"
        sp += f" --concurrency 1 --num-prompts 3 --warmup-requests 0 --no-progress --json {shared}"
        rc_shared = main(["bench", "serve", "--url", srv.url, *sp.split()])
    assert rc == 0 and rc_shared == 0
    _check_report(json.loads(out.read_text()), "ours")
    (point,) = json.loads(shared.read_text())["configs"][0]["points"]
    assert point["median"]["completed"] == 3
    assert point["median"]["cached_prompt_fraction"] > 0.5  # 2 x 64 of about 3 x 69 prompt tokens


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    """The server exits on its flags before loading a model: a small word tokenizer sizes the prompts, so
    this holds without the embedded model too."""
    from attnserve.bench.serve.synthetic import write_tokenizer_dir

    write_tokenizer_dir(tmp_path / "tokenizer", vocab_size=500)
    out = tmp_path / "bad.json"
    rc = main(["bench", "serve", "--launch", "--device cpu", "--compare", "bad=--no-such-flag 1", *SMALL,
               "--tokenizer", str(tmp_path / "tokenizer"), "--server-log-dir", str(tmp_path / "logs"),
               "--json", str(out)])
    assert rc == 1
    (cfg,) = json.loads(out.read_text())["configs"]
    assert cfg["label"] == "bad" and cfg["points"] == []
    assert "exited with code 2" in cfg["error"]
    assert "unrecognized arguments: --no-such-flag" in cfg["error"]  # the server's own message, from its log
