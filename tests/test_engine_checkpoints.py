"""The engine on tiny random checkpoints loaded from disk: EOS, paged batching, seeds, bad input, bf16 MLA/MoE."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_runs import max_rel_err, run_engine

from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.loader import load_model

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    lm = load_model(path, random_weights=True, seed=3)
    with torch.no_grad():  # std 0.02 leaves logits nearly flat; sharpen them so sampling and greedy differ
        lm.model.lm_head.weight.mul_(50)
    return lm


def test_eos_stops_a_request_and_others_continue(qwen3):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    free = run_engine(qwen3, prompts, 6)
    stop_at = free[0].token_ids[2]
    with_eos = dataclasses.replace(qwen3, eos_token_ids=[stop_at])
    runs = run_engine(with_eos, prompts, 6, params=SamplingParams(max_new_tokens=6))
    for run, f in zip(runs, free):
        if stop_at in f.token_ids:
            cut = f.token_ids.index(stop_at) + 1
            assert (run.token_ids, run.finish_reason) == (f.token_ids[:cut], "stop")
        else:
            assert (run.token_ids, run.finish_reason) == (f.token_ids, "length")
    assert runs[0].finish_reason == "stop" and len(runs[0].token_ids) <= 3


def test_batched_in_pages_equals_one_at_a_time(qwen3):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [4]]
    together = run_engine(qwen3, prompts, 5, page_size=2)
    alone = [run_engine(qwen3, [p], 5)[0] for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    for t, a in zip(together, alone):
        torch.testing.assert_close(t.logits, a.logits, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded(qwen3):
    def sample(seed):
        return run_engine(qwen3, [[5, 6, 7]], 12, params=SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                         seed=seed, ignore_eos=True))[0].token_ids

    a = sample(0)
    assert sample(0) == a
    assert any(sample(s) != a for s in (1, 2, 3))


@pytest.mark.parametrize(("prompt", "settings", "message"), [
    ([], {}, "no tokens"),
    ([1, 2], {"attention_backend": "no-such"}, "unknown attention backend"),
    ([1, 60], {}, r"token ids must be in \[0, 50\)"),
])
def test_bad_input_is_named(qwen3, prompt, settings, message):
    with pytest.raises(ValueError, match=message):
        run_engine(qwen3, [prompt], 2, **settings)


TINY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 8, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 64,
}


@pytest.mark.parametrize("sparse", [False, True])
def test_bf16_mla_moe_runs_with_float32_routing(tmp_path, monkeypatch, sparse):
    """On the CPU: bf16 weights and KV cache, routing in float32, logits within 5% of the fp32 model's."""
    from attnserve.models.moe import Experts

    if sparse:
        monkeypatch.setattr(Experts, "DENSE_MAX_PAIRS", 0)
    (tmp_path / "config.json").write_text(json.dumps(TINY_V3))
    lm32 = load_model(tmp_path, random_weights=True, dtype=torch.float32, seed=5)
    lm16 = load_model(tmp_path, random_weights=True, dtype=torch.bfloat16, seed=5)
    gate = lm16.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert lm16.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
    # every prefix of every prompt: the prefill logits at each position, batched as the engine likes
    prefixes = [p[:n] for p in prompts for n in range(1, len(p) + 1)]
    l32 = torch.stack([r.logits[0] for r in run_engine(lm32, prefixes, 1)])  # [8, vocab]
    runs16 = run_engine(lm16, prefixes, 1)
    l16 = torch.stack([r.logits[0] for r in runs16])  # [8, vocab]
    assert torch.isfinite(l16).all()
    assert max_rel_err(l16, l32) < 0.05
    assert all(len(r.token_ids) == 4 for r in run_engine(lm16, prompts, 4))
