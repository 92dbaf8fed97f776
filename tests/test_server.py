"""The OpenAI-compatible server on the embedded SmolLM2 (HTTP here, the engine in its own process), driven by the
real `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_server

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.needs_embedded_model  # the served model is the embedded SmolLM2

PROMPTS = ["The capital of France is", "1, 2, 3,", "def fibonacci(n):"]
MAX = 8


@pytest.fixture(scope="module")
def served():
    llm = LLM(device="cpu", max_total_tokens=4096, max_running_requests=16)
    reference = {
        "greedy": [o.text for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX))],
        "logprobs": llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, logprobs=5))[0].logprobs,
    }
    with running_server(llm.engine.config) as (url, state):
        yield url, state, reference


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    """POST the body to path, or another method when path reads "METHOD /path"."""
    method, _, path = path.rpartition(" ")
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.request(method or "POST", url + path, content=content, headers={"content-type": "application/json"},
                         timeout=120, **kw)


def test_greedy_completions_equal_the_engine_and_streams_concatenate(served, client):
    url, state, ref = served
    out = client.completions.create(model="test-model", prompt=PROMPTS, max_tokens=MAX, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ref["greedy"]
    assert out.usage.completion_tokens == MAX * len(PROMPTS) and out.usage.prompt_tokens > 0
    stream = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["greedy"][0]
    assert chunks[-1].usage.completion_tokens == MAX and chunks[-2].choices[0].finish_reason == "length"
    again = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=MAX, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the radix cache served the repeated prompt


def test_chat_streams_role_first_and_finish_last(served, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model="test-model", messages=messages, max_tokens=MAX, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    chunks = list(client.chat.completions.create(model="test-model", messages=messages, max_tokens=MAX,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_seeds_stop_n_echo_and_logprobs(served, client):
    url, state, ref = served
    kw = dict(model="test-model", prompt=PROMPTS[1], max_tokens=MAX, temperature=1.0)
    a = client.completions.create(seed=11, **kw).choices[0].text
    assert client.completions.create(seed=11, **kw).choices[0].text == a
    three = client.completions.create(seed=11, n=3, **kw)
    assert sorted(c.index for c in three.choices) == [0, 1, 2] and len({c.text for c in three.choices}) > 1
    stop = ref["greedy"][1][3:5]
    cut = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=MAX, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == ref["greedy"][1][: ref["greedy"][1].find(stop)]
    echo = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=MAX, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + ref["greedy"][0]
    lp = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                   logprobs=5).choices[0].logprobs
    expected = ref["logprobs"]
    assert len(lp.token_logprobs) == 4
    for got, want, top in zip(lp.token_logprobs, expected, lp.top_logprobs):
        assert abs(got - want.logprob) < 1e-4 and len(top) == 5
    chat = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_async_client(served):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(*[aclient.completions.create(model="test-model", prompt=p, max_tokens=MAX,
                                                                 temperature=0) for p in PROMPTS])
        await aclient.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(main()) == served[2]["greedy"]


def test_models_health_server_info_and_metrics(served):
    url, state, _ = served
    assert httpx.get(url + "/health").status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "test-model"
    info = httpx.get(url + "/server_info").json()
    assert info["attention_backend"]["decode"] and info["selection_trace"]
    assert info["kv_cache"]["pages_total"] > 0 and info["versions"]["torch"]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    assert "attnserve:time_to_first_token_seconds" in families and "attnserve:kv_pages" in families
    backend = families["attnserve:backend_info"].samples[0].labels
    assert backend["decode_backend"] == info["attention_backend"]["decode"]


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi " * 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 10**4}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    # a lone surrogate (escaped in JSON: valid JSON, not valid Unicode), wherever the text goes
    pytest.param("/v1/completions", b'{"prompt": "abc \\ud800", "max_tokens": 4}', 400, "prompt",
                 id="lone-surrogate-prompt"),
    pytest.param("/v1/completions", b'{"prompt": ["hi", "x\\udc00y"], "max_tokens": 4}', 400, "prompt",
                 id="lone-surrogate-prompt-list"),
    pytest.param("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4, "echo": true}', 400, "prompt",
                 id="lone-surrogate-echo"),
    pytest.param("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400,
                 "messages", id="lone-surrogate-chat"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "x\\ud800": 1}', 400, "x\\ud800",
                 id="lone-surrogate-key"),
    pytest.param("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
                 id="deeply-nested-json"),
    # the router's own errors have the OpenAI shape too
    pytest.param("GET /v1/completions", b"", 405, None, id="get-completions"),
    pytest.param("GET /v1/chat/completions", b"", 405, None, id="get-chat-completions"),
    pytest.param("POST /v1/models", {}, 405, None, id="post-models"),
    pytest.param("POST /v1/embeddings", {"input": "hi"}, 404, None, id="unknown-route"),
    pytest.param("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens",
                 id="max-tokens-over-the-pool"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_input_gets_a_4xx_naming_the_field_and_nothing_else_is_disturbed(served, path, body, status, param):
    url, state, ref = served
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    good = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == ref["greedy"][0]


def test_body_over_the_limit_is_413(served):
    url, state, _ = served
    r = _post(url, "/v1/completions", json.dumps({"prompt": "x" * (state.settings.max_request_bytes + 10)}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key_guards_v1_only(served, monkeypatch):
    url, state, _ = served
    monkeypatch.setattr(state.settings, "api_key", "sekrit")
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


def test_overload_is_503_with_retry_after(served, monkeypatch):
    url, state, _ = served
    monkeypatch.setattr(state.admission, "max_queued", 0)
    r = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"]


def test_concurrent_streams_with_disconnects_free_every_page(served):
    url, state, ref = served
    rng = random.Random(3)
    results: dict[int, str] = {}
    errors: list[str] = []

    def client_thread(i: int, leave_after: int | None):
        body = {"prompt": PROMPTS[i % 3], "max_tokens": MAX, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                text, k = "", 0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    text += json.loads(line[6:])["choices"][0]["text"]
                    k += 1
                    if leave_after is not None and k >= leave_after:
                        return  # closes the connection mid-stream
                results[i] = text
        except Exception as exc:  # noqa: BLE001 - collected
            errors.append(f"client {i}: {exc!r}")

    plan = [(i, rng.randrange(0, 4) if i % 3 == 0 else None) for i in range(32)]
    threads = [threading.Thread(target=client_thread, args=p) for p in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, leave in plan:
        if leave is None:
            assert results[i] == ref["greedy"][i % 3]
    info = None
    for _ in range(100):  # aborts of the disconnected ones land within an engine step
        info = httpx.get(url + "/server_info").json()
        if info["kv_cache"]["pages_in_use"] == 0:
            break
        threading.Event().wait(0.1)
    assert info["kv_cache"]["pages_in_use"] == 0 and info["running"] == 0
    list(text_string_to_metric_families(httpx.get(url + "/metrics").text))  # parses


def test_unset_max_tokens_is_clamped_to_what_the_pool_holds(served, client):
    """The pool (4096 tokens) is smaller than the context (8192): a request that leaves max_tokens unset is
    served, up to what the pool holds; a max_tokens the client did set over it keeps its 400 (the table)."""
    url, state, ref = served
    assert state.pool_tokens < state.engine.max_context_len
    chat = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Say hi."}],
                                          temperature=0, stop=["\n", "."])
    assert chat.choices[0].finish_reason == "stop"
    r = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": None, "temperature": 0, "stop": ["."]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(ref["greedy"][0].split(".")[0])


def _requests_by_reason(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {s.labels["finish_reason"]: s.value for f in families if f.name == "attnserve:requests"
            for s in f.samples if s.name == "attnserve:requests_total"}


def test_metrics_count_aborted_requests_with_their_finish_reason(served):
    url, state, _ = served
    before = _requests_by_reason(url)
    assert _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}).json()["choices"][0][
        "finish_reason"] == "length"
    body = {"prompt": PROMPTS[1], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for k, _ in enumerate(r.iter_lines()):
            if k >= 4:
                break  # leaves mid-stream
    after = before
    for _ in range(100):  # the server notices the disconnect within an engine step
        after = _requests_by_reason(url)
        if after.get("abort", 0) > before.get("abort", 0):
            break
        threading.Event().wait(0.1)
    # (the counts say, if it fails, whether the stream ran to its length unnoticed or was never counted)
    assert after.get("abort", 0) == before.get("abort", 0) + 1, f"finish reasons before {before}, after {after}"
    assert after.get("length", 0) == before.get("length", 0) + 1, f"finish reasons before {before}, after {after}"
