"""The engine with other attention shapes: MLA (DeepSeek-V2 with MoE, latent pool) and a sliding window.

Same check as the Llama tests: batched, chunked and preempted runs give the greedy
tokens of one-at-a-time runs, and every page comes back.
"""

import pytest
from engine_helpers import VOCAB, prompts, tiny_model

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

CONFIGS = {
    "deepseek-v2-mla-moe": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    },
    "mistral-sliding-window": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 7, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
    },
}
PROMPTS = prompts(8, seed=21, shared_prefix=6, lo=3, hi=30)


def _engine(bundle, **kw):
    cfg = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 2048,
           "chunked_prefill_size": None, "disable_radix_cache": True, **kw}
    return Engine(EngineConfig(**cfg), loaded=bundle)


def _outputs(engine, ps):
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for p in ps]
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_chunked_preempted_match_one_at_a_time(name):
    bundle = tiny_model(CONFIGS[name], seed=3)
    alone = [_outputs(_engine(bundle), [p])[0] for p in PROMPTS]
    e = _engine(bundle, page_size=4, max_total_tokens=64, chunked_prefill_size=12, disable_radix_cache=False)
    assert _outputs(e, PROMPTS) == alone
    assert e.scheduler.counters.preemptions > 0
    assert e.parts.kv.pool.is_mla == (name.startswith("deepseek"))
