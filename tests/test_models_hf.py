"""The engine against transformers on tiny random checkpoints (CPU, float32).

Each architecture is built with transformers from a small config, given random
norms and biases (so nothing that should be loaded can silently stay at its
init), saved as safetensors, loaded by attnserve and run by the engine itself
(scheduler, paged KV cache, sampler). The logits every step sampled from (the
prefill's, then each decode step's) must match transformers' to 1e-4 relative,
and the greedy tokens must be transformers' token for token.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from engine_runs import max_rel_err, run_engine

from attnserve.attention.layer import attention_step
from attnserve.kvcache.pool import make_pool
from attnserve.models.loader import load_model

VOCAB = 160
NEW_TOKENS = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run fastest (and steadiest on a busy 2-core box) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _llama_like(cls_name, **kw):
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}
    base.update(kw)
    return cls_name, base


def _deepseek(cls_name, **kw):
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32,
                "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 256,
                "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}
    base.update(kw)
    return cls_name, base


_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

CASES = {
    "llama3-rope-tied": _llama_like("Llama", tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}, rope_theta=500000.0),
    "llama-bias-sharded": _llama_like("Llama", attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    "mistral-sliding-window": _llama_like("Mistral", sliding_window=7, head_dim=16),
    "qwen2-qkv-bias": _llama_like("Qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3-qk-norm": _llama_like("Qwen3", head_dim=32, num_attention_heads=4, num_key_value_heads=1),
    "deepseek-v2-yarn-moe": _deepseek("DeepseekV2", rope_scaling=_YARN, topk_method="greedy"),
    # the latent down-projection has a bias and q_proj none: the merged projection's q part loads zeros
    "deepseek-v2-latent-bias": _deepseek("DeepseekV2", q_lora_rank=None, attention_bias=True, topk_method="greedy"),
    "deepseek-v2-group-limited": _deepseek("DeepseekV2", q_lora_rank=24, n_routed_experts=8, n_group=4,
                                           topk_group=2, topk_method="group_limited_greedy",
                                           routed_scaling_factor=1.5),
    "deepseek-v3-noaux": _deepseek("DeepseekV3", q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1,
                                   norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                                   rope_scaling=dict(_YARN, mscale=1.0, mscale_all_dim=1.0)),
    "deepseek-v3-neox-rope": _deepseek("DeepseekV3", q_lora_rank=None, n_routed_experts=4, n_group=1,
                                       topk_group=1, rope_interleave=False, tie_word_embeddings=True),
}


def _randomize_non_matrix_weights(model: torch.nn.Module, seed: int) -> None:
    """HF inits norms to 1 and biases to 0; make them random so a weight we fail to load shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _build(case: str, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    family, kw = CASES[case]
    cfg = getattr(transformers, f"{family}Config")(**kw)
    torch.manual_seed(hash(case) % 1000)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    _randomize_non_matrix_weights(hf, seed=len(case))
    out = tmp_path_factory.mktemp(case)
    shard = "40KB" if "sharded" in case else "1GB"
    hf.save_pretrained(out, max_shard_size=shard)
    if "sharded" in case:
        assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    hf.config._attn_implementation = "eager"
    return hf, str(out)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 5)]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_logits_and_greedy_match_transformers(case, tmp_path_factory):
    hf, path = _build(case, tmp_path_factory)
    lm = load_model(path, dtype=torch.float32)
    assert lm.format == "hf" and lm.config.architecture == f"{CASES[case][0]}ForCausalLM"
    prompts = _prompts(seed=len(case))
    page_size = 4 if case.startswith(("deepseek-v2", "mistral")) else 1  # pages that split requests unevenly
    runs = run_engine(lm, prompts, NEW_TOKENS, page_size=page_size)
    for prompt, run in zip(prompts, runs):
        with torch.no_grad():  # transformers on the same tokens: [NEW_TOKENS, vocab] at the sampled positions
            ref = hf(torch.tensor([prompt + run.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        rel = max_rel_err(run.logits[0], ref[0])
        assert rel < 1e-4, f"{case}: prefill logits differ, max relative error {rel:.2e}"
        rel = max_rel_err(run.logits[1:], ref[1:])
        assert rel < 1e-4, f"{case}: decode logits differ, max relative error {rel:.2e}"
        # transformers' greedy choice at every position is our token, so its greedy run is ours
        assert run.token_ids == ref.argmax(-1).tolist(), f"{case}: greedy continuation differs"
        assert run.finish_reason == "length" and len(run.token_ids) == NEW_TOKENS


def test_kv_cache_spec_describes_the_pool(tmp_path_factory):
    _, path = _build("deepseek-v2-yarn-moe", tmp_path_factory)
    spec = load_model(path).model.kv_cache_spec()
    assert (spec.is_mla, spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (True, 1, 32 + 8, 32)
    assert spec.attention_type == "MLA" and make_pool(spec, 4, 1, "fp32").head_dim == 40
    _, path = _build("mistral-sliding-window", tmp_path_factory)
    spec = load_model(path).model.kv_cache_spec()
    assert (spec.is_mla, spec.num_kv_heads, spec.head_dim, spec.sliding_window) == (False, 2, 16, 7)
    assert spec.attention_type == "GQA"


def test_logits_indices_select_rows(tmp_path_factory):
    _, path = _build("qwen3-qk-norm", tmp_path_factory)
    lm = load_model(path)
    prompts = _prompts(seed=3)
    from attnserve.batch import ForwardBatch, ForwardMode
    from attnserve.choice.registry import create_backend

    spec = lm.model.kv_cache_spec()
    total = sum(map(len, prompts))
    pool = make_pool(spec, total + 1, 1, "fp32")
    req_to_token = torch.zeros(2, max(map(len, prompts)), dtype=torch.int32)
    req_to_token[0, :13] = torch.arange(1, 14)
    req_to_token[1, :5] = torch.arange(14, 19)
    backend = create_backend("torch_native", pool)
    fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, [0, 1], [0, 0], [13, 5], req_to_token, pool)
    ids = torch.tensor([t for p in prompts for t in p])
    last = torch.tensor([12, 17])
    with torch.no_grad(), attention_step(backend, backend.plan(fb)):
        full = lm.model(ids, fb.positions, fb)  # [18, vocab]: every position
        picked = lm.model(ids, fb.positions, fb, logits_indices=last)
    assert picked.shape == (2, VOCAB)
    torch.testing.assert_close(picked, full[last], rtol=1e-5, atol=1e-5)


def test_moe_paths_agree():
    """Decode-sized batches take the grouped or dense paths, prefill the per-expert loop: all give one mixture."""
    from attnserve.models.moe import Experts

    torch.manual_seed(0)
    experts = Experts(num_experts=6, hidden_size=16, intermediate_size=8, hidden_act="silu")
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(9, 16)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])  # [9, 2], distinct experts per token
    weights = torch.rand(9, 2)
    dense = experts.forward_dense(x, weights, ids)
    sparse = experts.forward_sparse(x, weights, ids)
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts.forward_grouped(x, weights, ids), sparse, rtol=1e-5, atol=1e-5)
    one = experts(x[:2], weights[:2], ids[:2])  # 4 choices < 6 experts: the grouped path
    torch.testing.assert_close(one, sparse[:2], rtol=1e-5, atol=1e-5)
    # an expert no token routes to contributes nothing
    ids[:, :] = torch.tensor([0, 1])
    torch.testing.assert_close(experts.forward_dense(x, weights, ids), experts.forward_sparse(x, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_rope_past_the_trained_context(tmp_path):
    """Dynamic NTK changes the RoPE base once positions pass max_position_embeddings (16 here)."""
    cfg = transformers.LlamaConfig(**{**CASES["llama-bias-sharded"][1], "attention_bias": False, "mlp_bias": False,
                                      "max_position_embeddings": 16,
                                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    hf.config._attn_implementation = "eager"
    lm = load_model(tmp_path, dtype=torch.float32)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 21)]
    for prompt in prompts:
        # one at a time: batched requests share the RoPE base of the batch's longest (see RotaryEmbedding)
        run, = run_engine(lm, [prompt], 10, max_context_len=64)  # past the trained 16 positions
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf(ids).logits[0, -1]  # [vocab]
            # transformers' incremental generate, whose RoPE base changes with the length reached
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert max_rel_err(run.logits[0], ref) < 1e-4
        assert run.token_ids == expected
