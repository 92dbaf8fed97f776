"""Speculative decoding behind the OpenAI-compatible server (the embedded SmolLM2, n-gram drafts): greedy text
equals the engine's without speculation, the usage reports what was drafted and kept, a request can opt out, and
/metrics and /server_info show the totals."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_server

from attnserve.engine.config import EngineConfig
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.needs_embedded_model  # the served model is the embedded SmolLM2

# the model continues the prompt's own list, so prompt lookup finds drafts that it keeps
PROMPT = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday, Wednesday,"
MAX = 24


@pytest.fixture(scope="module")
def served():
    # fp32 on the CPU: verify and decode steps then round alike, so greedy text is token-identical
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    plain = LLM(device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4)
    reference = plain.generate(PROMPT, SamplingParams(max_new_tokens=MAX))[0].text
    with running_server(config) as (url, state):
        yield url, reference


def _complete(url: str, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_text_is_unchanged_and_usage_counts_the_drafts(served):
    url, reference = served
    body = _complete(url)
    assert body["choices"][0]["text"] == reference
    spec = body["usage"]["x_speculative"]
    assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0
    assert spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
    # fewer steps than tokens: accepted drafts came several to a step
    assert spec["verify_steps"] < body["usage"]["completion_tokens"]


def test_a_request_can_opt_out(served):
    url, reference = served
    body = _complete(url, speculative=False)
    assert body["choices"][0]["text"] == reference
    assert "x_speculative" not in body["usage"]
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "speculative": "no"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


def test_streamed_usage_and_the_server_totals(served):
    url, _ = served
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"x_speculative"' in lines[-1]

    info = httpx.get(url + "/server_info", timeout=30).json()
    assert info["speculative"]["algorithm"] == "ngram" and info["speculative"]["num_draft_tokens"] == 4
    assert info["speculative"]["verify_backend"] == "torch_native"
    stats = info["speculative_stats"]
    assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > 0

    text = httpx.get(url + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["attnserve:spec_accepted_tokens_total"] >= stats["accepted_tokens"]
    assert samples["attnserve:spec_draft_tokens_total"] >= samples["attnserve:spec_accepted_tokens_total"]
    assert 0 < samples["attnserve:spec_acceptance_rate"] <= 1
