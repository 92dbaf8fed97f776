"""The minimal generation loop: stopping, sampling seeds, batching and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from attnserve.models.driver import generate
from attnserve.models.loader import load_model

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    lm = load_model(path, random_weights=True, seed=3)
    with torch.no_grad():  # std 0.02 leaves logits nearly flat; sharpen them so sampling and greedy differ
        lm.model.lm_head.weight.mul_(50)
    return lm.model


def test_eos_stops_a_request_and_others_continue(model):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    free = generate(model, prompts, max_new_tokens=6)
    stop_at = free[0].token_ids[2]
    gens = generate(model, prompts, max_new_tokens=6, eos_token_ids=[stop_at])
    for g, f in zip(gens, free):
        if stop_at in f.token_ids:
            cut = f.token_ids.index(stop_at) + 1
            assert (g.token_ids, g.finish_reason) == (f.token_ids[:cut], "stop")
        else:
            assert (g.token_ids, g.finish_reason) == (f.token_ids, "length")
    assert gens[0].finish_reason == "stop" and len(gens[0].token_ids) <= 3


def test_batched_equals_one_at_a_time(model):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [4]]
    together = generate(model, prompts, max_new_tokens=5, page_size=2)
    alone = [generate(model, [p], max_new_tokens=5)[0] for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_sampling_is_seeded(model):
    prompt = [[5, 6, 7]]
    a = generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=0)[0].token_ids
    b = generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=0)[0].token_ids
    others = [generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=s)[0].token_ids for s in (1, 2, 3)]
    assert a == b
    assert any(o != a for o in others)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompts": [[]]}, "at least one token"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"attention_backend": "no-such"}, "unknown attention backend"),
])
def test_bad_arguments(model, kwargs, message):
    args = {"prompts": [[1, 2]], **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, **args)


TINY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 8, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 64,
}


@pytest.mark.parametrize("sparse", [False, True])
def test_bf16_mla_moe_runs_with_float32_routing(tmp_path, monkeypatch, sparse):
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
    _, l32 = generate(lm32.model, prompts, max_new_tokens=4, return_prefill_logits=True)
    g16, l16 = generate(lm16.model, prompts, max_new_tokens=4, return_prefill_logits=True)
    assert l16.dtype == torch.float32 and torch.isfinite(l16).all()
    assert (l16 - l32).abs().max() < 0.05 * l32.abs().max()
    assert all(len(g.token_ids) == 4 for g in g16)
