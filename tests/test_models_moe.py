"""Routed experts against a per-token loop, and what makes the decode paths safe to capture.

The reference runs each token through each of its chosen experts one at a time. Batches
mix tokens whose choices overlap, so a path that mixes up which pair belongs to which
token or expert gives a wrong sum.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from attnserve.models import moe
from attnserve.models.moe import Experts

HIDDEN, INTER, NUM_EXPERTS = 64, 32, 16


def _experts(dtype=torch.float32, device="cpu", num_experts=NUM_EXPERTS):
    experts = Experts(num_experts, HIDDEN, INTER, "silu").to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * HIDDEN**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * INTER**-0.5)
    return experts


def _overlapping_batch(tokens=5, top_k=3, seed=1, device="cpu", dtype=torch.float32):
    """Distinct experts per token, shared across tokens; experts 0 and 15 chosen by no one."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([3, 7, 8, 11, 12])  # a few popular experts
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])  # [T, k]
    ids[0, 0] = 5  # one expert chosen by a single token
    x = torch.randn(tokens, HIDDEN, generator=g).to(device=device, dtype=dtype)  # [T, hidden]
    weights = torch.rand(tokens, top_k, generator=g).to(device)  # [T, k] float32, as the router gives
    return x, weights, ids.to(device)


def _per_token_reference(experts, x, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t].double().cpu(), experts.gate_up_proj[e].double().cpu()).chunk(2)
            y = F.linear(F.silu(gate) * up, experts.down_proj[e].double().cpu())
            out[t] += float(weights[t, j]) * y
    return out


def _rel_err(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("path", ["forward_grouped", "forward_sparse", "forward_dense"])
def test_every_path_matches_per_token_reference(path):
    experts = _experts()
    x, weights, ids = _overlapping_batch()
    out = getattr(experts, path)(x, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _rel_err(out, _per_token_reference(experts, x, weights, ids)) < 1e-5


def test_bf16_grouped_path_matches_reference():
    experts = _experts(torch.bfloat16)
    x, weights, ids = _overlapping_batch(dtype=torch.bfloat16)
    assert experts.grouped_mm_applies(x)
    assert _rel_err(experts.forward_grouped(x, weights, ids), _per_token_reference(experts, x, weights, ids)) < 2e-2


class _Recorder(TorchDispatchMode):
    """Every op run and the largest new tensor any of them produced (views of their inputs aside)."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = set(), (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops.add(name)
        inputs = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.largest = max(self.largest, (t.numel(), name))
        return out


# ops whose output size or value the host must read: each would break a CUDA graph capture
HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                 "masked_select", "item"}


@pytest.mark.parametrize("path", ["forward_grouped", "forward_dense"])
def test_decode_paths_copy_no_expert_weights_and_read_nothing_back(path):
    """The decode paths' temporaries stay activation-sized, and no op depends on routed values for shapes."""
    experts = _experts()
    x, weights, ids = _overlapping_batch()
    one_expert = experts.gate_up_proj[0].numel()  # 2I * hidden
    with _Recorder() as rec:
        getattr(experts, path)(x, weights, ids)
    if path == "forward_grouped":
        assert rec.largest[0] < one_expert, f"{rec.largest[1]} made a temporary as large as an expert's weights"
        assert "_grouped_mm" in rec.ops
    assert not rec.ops & HOST_SYNC_OPS, rec.ops & HOST_SYNC_OPS


def test_small_batches_choose_a_path_that_fits_where_they_run(monkeypatch):
    """Grouped where it applies; else the per-expert loop when eager and the dense path while capturing."""
    experts = _experts()
    x, weights, ids = _overlapping_batch()  # 15 choices < 16 experts
    called = []
    for name in ("forward_grouped", "forward_sparse", "forward_dense"):
        monkeypatch.setattr(experts, name, lambda *a, _n=name: called.append(_n) or torch.zeros_like(a[0]))
    experts(x, weights, ids)
    monkeypatch.setattr(Experts, "grouped_mm_applies", lambda self, x: False)
    experts(x, weights, ids)
    monkeypatch.setattr(moe, "_capturing", lambda x: True)
    experts(x, weights, ids)
    assert called == ["forward_grouped", "forward_sparse", "forward_dense"]
    x, weights, ids = _overlapping_batch(tokens=8, top_k=2)  # 16 choices: no longer "a few"
    experts(x, weights, ids)
    assert called[-1] == "forward_dense"


def test_large_batches_take_the_grouped_gemm_on_a_gpu_only(monkeypatch):
    """From GROUPED_MIN_PAIRS token x expert pairs on, the grouped GEMM where it is a device kernel."""
    experts = _experts()  # 16 experts
    called = []
    for name in ("forward_grouped", "forward_sparse", "forward_dense"):
        monkeypatch.setattr(experts, name, lambda *a, _n=name: called.append(_n) or torch.zeros_like(a[0]))
    monkeypatch.setattr(Experts, "GROUPED_MIN_PAIRS", 16 * 8)
    below, at = _overlapping_batch(tokens=7, top_k=3), _overlapping_batch(tokens=8, top_k=3)
    experts(*at)  # on the CPU the grouped GEMM is a loop: dense as before
    monkeypatch.setattr(moe, "_on_gpu", lambda x: True)
    experts(*below)
    experts(*at)
    monkeypatch.setattr(Experts, "grouped_mm_applies", lambda self, x: False)
    experts(*at)
    assert called == ["forward_dense", "forward_dense", "forward_grouped", "forward_dense"]


def test_grouped_path_needs_matching_dtypes():
    experts = _experts()
    assert experts.grouped_mm_applies(torch.zeros(2, HIDDEN))
    assert not experts.grouped_mm_applies(torch.zeros(2, HIDDEN, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_path_in_a_cuda_graph():
    """bf16 decode batch on the GPU: captured once, replayed with other routing, still the reference."""
    experts = _experts(torch.bfloat16, "cuda")
    x, weights, ids = _overlapping_batch(device="cuda", dtype=torch.bfloat16)
    if not experts.grouped_mm_applies(x):
        pytest.skip("torch's grouped GEMM has no device kernel on this GPU")
    static = [t.clone() for t in (x, weights, ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts(*static)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(*static)
    x2, w2, ids2 = _overlapping_batch(seed=7, device="cuda", dtype=torch.bfloat16)
    for buf, new in zip(static, (x2, w2, ids2)):
        buf.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, _per_token_reference(experts, x2, w2, ids2)) < 2e-2


# ---- the fused MoE kernel where the op set has it --------------------------------------------------------

def test_every_batch_takes_the_fused_kernel_where_the_op_set_has_it(monkeypatch):
    """Whatever the batch size; not for an activation the kernel does not compute, nor across dtypes."""
    from attnserve.ops import TORCH_OPS

    experts = _experts()
    called = []
    monkeypatch.setattr(experts, "ops", dataclasses.replace(TORCH_OPS, fused_moe=lambda x, *a, **k: called.append(len(x)) or x))
    for tokens in (1, 8, 600):
        experts(*_overlapping_batch(tokens=tokens))
    assert called == [1, 8, 600]
    assert not experts.fused_applies(torch.zeros(2, HIDDEN, dtype=torch.bfloat16))
    experts.act = F.gelu
    assert not experts.fused_applies(torch.zeros(2, HIDDEN))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_layer_with_shared_experts_same_with_fused_ops_on_and_off(dtype, tol):
    """Router, routed experts through the Triton kernel (the interpreter on the CPU) and two shared experts."""
    pytest.importorskip("triton")
    from attnserve.models.config import ModelConfig
    from attnserve.models.layers import use_ops
    from attnserve.models.moe import MoE
    from attnserve.ops import TORCH_OPS, triton_ops

    cfg = ModelConfig.from_hf({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 128,
        "hidden_size": HIDDEN, "intermediate_size": 96, "moe_intermediate_size": INTER, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 2,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "max_position_embeddings": 64,
    })
    layer = MoE(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the kernel under the interpreter
    layer = layer.to(device=device, dtype=dtype)
    layer.gate.float()  # the router stays float32, as the model keeps it
    x = torch.randn(5, HIDDEN, generator=g).to(device=device, dtype=dtype)  # [T, hidden]
    unfused = layer(x)
    use_ops(layer, triton_ops())
    assert layer.experts.fused_applies(x) and layer.experts.shared_fits(layer.shared_experts, x)
    fused = layer(x)
    assert _rel_err(fused, unfused.double().cpu()) < tol
    layer.shared_experts.act = F.gelu  # shared experts the kernel cannot run: their output is added
    assert not layer.experts.shared_fits(layer.shared_experts, x)
    layer.experts.ops = TORCH_OPS
    unfused = layer(x)
    layer.experts.ops = triton_ops()
    assert _rel_err(layer(x), unfused.double().cpu()) < tol
