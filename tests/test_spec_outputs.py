"""What speculative decoding shows its consumers: the flags, several tokens per delta cut at a stop
string as single tokens would be, the per-request counters in `generate --json`, and the embedded
model (real weights, real tokenizer) giving the same greedy text with drafts accepted."""

from __future__ import annotations

import pytest

from attnserve.cli import main
from attnserve.commands import generate
from attnserve.engine.outputs import RequestStream, TokenDelta
from attnserve.engine.sampling_params import SamplingParams


class _Captured(Exception):
    pass


def test_flags_reach_the_engine(monkeypatch):
    seen = {}

    def fake_llm(*, config):
        seen.update(vars(config))
        raise _Captured

    monkeypatch.setattr(generate, "LLM", fake_llm)
    with pytest.raises(_Captured):
        main(["generate", "hi", "--quiet", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
              "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
              "--speculative-ngram-min-match-window-size", "1", "--speculative-ngram-max-match-window-size", "5",
              "--speculative-attention-mode", "decode"])
    assert seen["speculative_algorithm"] == "ngram"
    assert (seen["speculative_num_draft_tokens"], seen["speculative_num_steps"], seen["speculative_eagle_topk"]) == (6, 3, 2)
    assert (seen["speculative_ngram_min_match_window_size"], seen["speculative_ngram_max_match_window_size"]) == (1, 5)
    assert seen["speculative_attention_mode"] == "decode"


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _stream():
    return RequestStream(CharTokenizer(), SamplingParams(stop=["END"]), "p", [1], 0.0)


def _delta(ids):
    return TokenDelta(token_ids=tuple(ids), times=tuple(float(i) for i in range(len(ids))), logprobs=None,
                      cached_tokens=0, num_preemptions=0)


def test_a_delta_of_several_tokens_stops_where_single_tokens_would():
    ids = [ord(c) for c in "abc ENDxyz"]
    one = _stream()
    for i in ids:
        if one.finished:
            break
        one.push(_delta([i]))
    many = _stream()
    many.push(_delta(ids[:3]))
    many.push(_delta(ids[3:]))  # the stop string completes in the middle of this delta
    assert many.output.text == one.output.text == "abc "
    assert many.output.token_ids == one.output.token_ids == ids[:7]
    assert many.stop_hit and many.output.finish_reason == "stop"


@pytest.mark.needs_embedded_model
def test_embedded_model_same_greedy_with_drafts_accepted_and_json_counters():
    from attnserve.engine.llm import LLM

    code = "def area(width, height):\n    result = width * height\n    return result\n"
    prompt = f"Repeat this code exactly:\n{code}\nHere it is again:\n"
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # fp32: a request's tokens do not depend on how many rows a step has (bf16 / int4 pick kernels by rows)
    llm = LLM(device="cpu", dtype="fp32", max_total_tokens=1024, speculative_algorithm="ngram")
    drafter, llm.engine.drafter = llm.engine.drafter, None
    plain = llm.generate(prompt, params)[0]  # the same engine, decoding one token per step
    llm.engine.drafter = drafter
    llm.engine.flush_cache()
    spec = llm.generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.spec_accepted_tokens > 0 and spec.spec_verify_steps > 0
    assert llm.engine.pages_leaked() == 0
    line = {**spec.to_json(), **spec.spec_json()}  # what `generate --json` prints per completion
    assert line["spec_accepted_tokens"] == spec.spec_accepted_tokens
    assert 0 < line["spec_acceptance_rate"] <= 1
    totals = generate._totals(llm, [spec], 1.0)
    assert totals["speculative"]["accepted_tokens"] == spec.spec_accepted_tokens
