"""The offline LLM API: ordering, n completions, stop strings, streaming, seeds, early exit."""

import pytest
import torch
from engine_helpers import VOCAB, shared_model, tiny_llama

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26), plus a space every 7th id: enough to test text handling."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def encode(self, text):
        return [ord(c) - 97 for c in text if "a" <= c <= "z"] or [0]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) + (" " if i % 7 == 0 else "") for i in ids)


@pytest.fixture(scope="module")
def llm():
    bundle = shared_model()
    bundle.tokenizer = CharTokenizer()
    try:
        yield LLM(loaded=bundle, device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
    finally:
        bundle.tokenizer = None


def test_outputs_in_input_order_with_text_and_timing(llm):
    prompts = ["hello", "the quick brown fox", "jumps", "over the lazy dog"]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert o.text == CharTokenizer().decode(o.token_ids)
        assert o.ttft_s > 0 and o.tpot_s > 0 and len(o.token_latencies_s) == 5
        assert set(o.to_json()) >= {"prompt", "text", "token_ids", "finish_reason", "ttft_s", "tpot_s"}
    # one at a time gives the same greedy tokens
    alone = llm.generate(prompts[1], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert alone[0].token_ids == outs[1].token_ids
    assert llm.engine.pages_leaked() == 0


def test_stop_string_cuts_text_and_stream_never_shows_it(llm):
    base = llm.generate("abc", SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    stop = base.text[3:5]
    events = list(llm.stream("abc", SamplingParams(max_new_tokens=10, ignore_eos=True, stop=[stop])))
    final = events[-1].output
    assert final.finish_reason == "stop" and final.matched_stop == stop
    assert final.text == base.text[: base.text.find(stop)]
    assert "".join(e.text for e in events) == final.text


@pytest.fixture(scope="module")
def flat_llm():
    """A model whose logits are all zero (its LM head is zeroed): every step's distribution is uniform."""
    bundle = tiny_llama(seed=4, layers=1, hidden=32, heads=2, kv_heads=1)
    with torch.no_grad():
        bundle.model.lm_head.weight.zero_()
    return LLM(loaded=bundle, device="cpu", max_total_tokens=512, attention_backend="torch_native")


def test_n_completions_and_seeds(flat_llm):
    """Identical logits every step, so a generator restarted per step would repeat its first token.

    24 draws from 512 equally likely tokens are almost all distinct; the seeds make the check deterministic.
    """
    p = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, n=3, ignore_eos=True)
    outs = flat_llm.generate([[1, 2, 3]], p)
    assert [(o.index, o.completion) for o in outs] == [(0, 0), (0, 1), (0, 2)]
    assert len({tuple(o.token_ids) for o in outs}) == 3  # different seeds, different samples
    assert all(len(set(o.token_ids)) > len(o.token_ids) // 2 for o in outs)
    # in a batch with other requests (sampled, seeded or not, finishing at other steps): the same tokens
    others = [SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=6, max_new_tokens=7, ignore_eos=True)]
    again = flat_llm.generate([[4, 5], [1, 2, 3], [6]], [others[0], p, others[1]])
    assert [o.token_ids for o in again[1:4]] == [o.token_ids for o in outs]


def test_closing_a_stream_early_aborts_and_frees(llm):
    stream = llm.stream(["abandon me", "me too"], SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(3):
        next(stream)
    stream.close()
    assert not llm.engine.has_work()
    assert llm.engine.pages_leaked() == 0


def test_chat_template_and_bad_input(llm):
    assert llm.apply_chat_template("hi") == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[VOCAB + 5]])
    assert not llm.engine.has_work()


def test_chat_template_from_the_model_file_is_sandboxed(llm, monkeypatch):
    import jinja2

    monkeypatch.setattr(llm.engine.parts.model, "chat_template", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        llm.apply_chat_template("hi")
    # the helpers HF templates rely on are there too
    monkeypatch.setattr(llm.engine.parts.model, "chat_template",
                        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                        "{{ messages[0].content | tojson }}")
    assert llm.apply_chat_template("hi") == '"hi"'
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        llm.apply_chat_template("hi", system="be brief")


def test_startup_log_names_what_runs(llm):
    text = "\n".join(llm.engine.parts.startup_lines)
    for needle in ("model:", "device: cpu", "KV pool: 2048 tokens", "page size 1", "prefill torch_native",
                   "decode torch_native", "CUDA graphs: off", "chunked prefill 16", "radix cache on"):
        assert needle in text, needle


def test_the_earliest_stop_string_in_the_text_wins_whatever_the_list_order(llm):
    base = llm.generate("abc", SamplingParams(max_new_tokens=12, ignore_eos=True))[0].text
    early, late = base[2:4], base[6:9]
    assert base.find(early) < base.find(late)
    out = llm.generate("abc", SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[late, early]))[0]
    assert out.matched_stop == early and out.text == base[: base.find(early)]
    # the tokens kept are those that produced the text up to the match
    assert CharTokenizer().decode(out.token_ids).startswith(out.text + early[:1])


def test_logprobs_are_the_log_softmax_of_the_engine_logits(llm):
    seen = []
    real_forward = llm.engine.runner.forward

    def forward(batch):
        logits = real_forward(batch)
        seen.append(logits.detach().clone())
        return logits

    llm.engine.runner.forward = forward
    try:
        out = llm.generate("logits", SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.7, seed=3,
                                                    logprobs=5))[0]
    finally:
        llm.engine.runner.forward = real_forward
    assert len(out.logprobs) == 4 and len(seen) == 4
    for lp, logits in zip(out.logprobs, seen):
        ref = torch.log_softmax(logits[-1].double(), dim=-1)
        assert abs(lp.logprob - ref[lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
        assert all(abs(v - ref[t].item()) < 1e-4 for t, v in lp.top)
