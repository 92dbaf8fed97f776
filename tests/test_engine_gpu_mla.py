"""A DeepSeek (MLA + MoE) model through the engine on a GPU: every MLA backend gives the same greedy tokens.

The latent widths are DeepSeek's real ones (512 latent + 64 rope), the only ones FlashInfer's MLA kernels
take, and the model is bf16 with CUDA graphs on, as it is served. The rest is small (2 layers, 16 heads,
4 experts) so the test runs in seconds. The same comparison on the CPU (triton under the interpreter
against torch_native, in float32, scaled-down widths) is test_triton_mla_backend.py's tiny DeepSeek test.

In bf16 two correct kernels round differently, so where the reference's two best logits are nearly tied a
greedy choice may flip and the continuations part. The check is therefore: the logits agree within bf16's
error at every step the runs share, the tokens are identical up to the end or to a step whose top two
logits were within that error, and at least a third of the requests are identical to the end. How many are
is luck at near-ties, not a measure of error: on the H200 (page 64, benchmarks/results/logs/
engine-gpu-mla-greedy-diag.log) triton's extend as decode rows kept 4 of 10, its tile kernel 7 and FlashInfer 5,
at the same logit error against torch_native (mean 0.66-0.68% of the largest logit, at most 1.1%); the model
in float32 against bf16 on the CPU: 7 of 10, logits within 1.2% of the largest.
"""

import pytest
import torch
from engine_helpers import VOCAB, prompts, tiny_model
from engine_runs import record_logits

from attnserve._lazy import is_installed
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"

TINY_DEEPSEEK_REAL_LATENT = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": VOCAB,
    "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
}
NEW = 12
PROMPTS = prompts(10, seed=11, shared_prefix=6, lo=3, hi=200)
_BUNDLES: dict[int, object] = {}


def _model(heads: int = 16):
    if heads not in _BUNDLES:
        config = {**TINY_DEEPSEEK_REAL_LATENT, "num_attention_heads": heads, "num_key_value_heads": heads}
        _BUNDLES[heads] = tiny_model(config, seed=4, dtype=torch.bfloat16, device=DEVICE, matrix_std=None)
    return _BUNDLES[heads]


def _greedy(page_size: int, heads: int = 16, **backends) -> list[tuple[list[int], torch.Tensor]]:
    """(tokens, logits [tokens, vocab] each was chosen from) per prompt."""
    cfg = EngineConfig(device=DEVICE, dtype="bf16", page_size=page_size, max_total_tokens=8192,
                       max_running_requests=16, cuda_graph_max_bs=16, chunked_prefill_size=64, **backends)
    engine = Engine(cfg, loaded=_model(heads))
    rows = record_logits(engine)
    reqs = []
    for p in PROMPTS:  # staggered, so prefill chunks, mixed steps and graphed decode all run
        reqs.append(engine.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)))
        engine.step()
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    if "torch_native" not in backends.values():  # the reference backend runs eagerly
        assert engine.runner.steps_graphed > 0
    return [(r.output_ids, torch.stack(rows[r.rid][:NEW])) for r in reqs]


def assert_same_greedy(got, ref, logit_tol: float = 0.03) -> None:
    """See the module docstring; logit_tol is relative to the largest reference logit of the step."""
    identical = 0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        shared = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        for step in range(min(shared + 1, len(ref_tokens))):  # up to and including the first differing step
            scale = ref_logits[step].abs().max()
            assert (logits[step] - ref_logits[step]).abs().max() <= logit_tol * scale, f"step {step}"
        if shared == len(ref_tokens):
            identical += 1
            continue
        top2 = ref_logits[shared].topk(2).values
        assert top2[0] - top2[1] <= 2 * logit_tol * ref_logits[shared].abs().max(), (
            f"tokens part at step {shared} although the reference's choice led by {float(top2[0] - top2[1]):.3f}")
    assert identical >= len(ref) // 3, f"only {identical} of {len(ref)} requests identical to the end"


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 64])
def test_deepseek_greedy_tokens_equal_across_mla_backends(page_size):
    ref = _greedy(page_size, attention_backend="torch_native")
    assert_same_greedy(_greedy(page_size, attention_backend="triton"), ref)
    if is_installed("flashinfer"):  # the H200 runs carry FlashInfer; the comparison then includes it
        assert_same_greedy(_greedy(page_size, attention_backend="flashinfer"), ref)
        assert_same_greedy(_greedy(page_size, prefill_attention_backend="flashinfer",
                                   decode_attention_backend="triton"), ref)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 64])
def test_deepseek_128_heads_on_the_hopper_gluon_kernel(page_size):
    """128 heads (DeepSeek-V3's count): on Hopper the triton backend decodes on a warp-specialised Gluon kernel
    (the sm90 table's rule), graphed in the engine, with the same greedy tokens as torch_native."""
    from attnserve.attention.kernels.gpu_target import target_for
    from attnserve.attention.kernels.plan import LayerSignature
    from attnserve.attention.kernels.resolve import default_mla_decode_config

    if torch.cuda.get_device_capability()[0] == 9:
        sig = LayerSignature.of_gpu(target_for(torch.device(DEVICE)), family="mla", num_heads=128, num_kv_heads=1,
                                    head_dim=576, v_head_dim=512, page_size=page_size, q_dtype=torch.bfloat16,
                                    kv_dtype=torch.bfloat16, kv_lora_rank=512)
        assert default_mla_decode_config(sig).kernel.startswith("gluon")
    ref = _greedy(page_size, 128, attention_backend="torch_native")
    assert_same_greedy(_greedy(page_size, 128, attention_backend="triton"), ref)
