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
