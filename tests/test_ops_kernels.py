"""Every fused op's Triton kernel against the unfused torch composition it replaces.

In float32 (under the Triton interpreter on a CPU, natively on a GPU) they must match to
float32 rounding; in bf16 on a GPU (skipped without CUDA) to within a couple of bf16 ulps.
Shapes are ragged (row widths that are not powers of two, partial rotary dims, GQA).
"""

import pytest
import torch
from attention_helpers import rel_err

from attnserve.kvcache.pool import MHAKVPool
from attnserve.models.config import RopeConfig
from attnserve.models.rope import RotaryEmbedding
from attnserve.ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the Triton interpreter (conftest sets it)
DEVICES = [
    pytest.param(DEVICE, torch.float32, 1e-6, id="fp32"),
    pytest.param("cuda", torch.bfloat16, 8e-3, id="cuda-bf16", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


def _rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * scale).to(device, dtype)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 96), (3, 576)])
def test_rmsnorm_and_add_rmsnorm_match_the_composition(device, dtype, tol, rows, width):
    from attnserve.ops.kernels.rmsnorm import add_rmsnorm, rmsnorm

    x = _rand(rows, width, dtype=dtype, device=device, scale=3.0)  # [T, N]
    res = _rand(rows, width + 1, dtype=dtype, device=device)[:, :width]  # [T, N], row stride != width
    w = _rand(width, dtype=dtype, device=device) + 1.0  # [N]
    assert rel_err(rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6)) < tol
    out, new_res = add_rmsnorm(x, res, w, 1e-5)
    ref_out, ref_res = reference.add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the residual stream is the same rounded sum
    assert rel_err(out, ref_out) < tol
    assert out.dtype == new_res.dtype == dtype


def test_rmsnorm_rejects_a_weight_of_the_wrong_width():
    from attnserve.ops.kernels.rmsnorm import rmsnorm

    with pytest.raises(ValueError, match="a weight \\[N\\]"):
        rmsnorm(torch.ones(2, 8), torch.ones(6), 1e-6)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("rows,width", [(1, 48), (4, 1536), (2, 1100)])
def test_silu_mul_matches_the_composition(device, dtype, tol, rows, width):
    from attnserve.ops.kernels.silu_mul import silu_mul

    gate_up = _rand(rows, 2 * width, dtype=dtype, device=device, scale=4.0)  # [T, 2N]
    out = silu_mul(gate_up)
    assert out.shape == (rows, width)
    assert rel_err(out, reference.silu_mul(gate_up)) < tol


def test_silu_mul_rejects_an_odd_width():
    from attnserve.ops.kernels.silu_mul import silu_mul

    with pytest.raises(ValueError, match="2 \\* N"):
        silu_mul(torch.ones(2, 7))


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("hq,hk,d,rot,interleaved", [
    (4, 2, 16, 16, False),  # GQA, whole head rotated
    (3, 3, 24, 8, False),  # partial rotary: channels 8..23 pass through
    (4, 1, 16, 16, True),  # interleaved pairs (DeepSeek layout)
])
def test_rope_store_matches_rotate_then_store(device, dtype, tol, hq, hk, d, rot, interleaved):
    from attnserve.ops.kernels.rope_store import rope_store_kv

    tokens, page_size, num_pages = 7, 4, 6
    rotary = RotaryEmbedding(rot, RopeConfig(theta=10000.0), 4096, interleaved=interleaved).to(device)
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 1000], device=device)  # [T]
    cos, sin = rotary.cos_sin(positions, dtype)  # each [T, rot/2]
    qkv = _rand(tokens, (hq + 2 * hk) * d, dtype=dtype, device=device, scale=2.0)  # [T, (Hq + 2 Hk) D]
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)  # strided views of qkv
    loc = torch.tensor([5, 6, 7, 8, 13, 14, 22], device=device)  # [T] slots, not contiguous

    ref_pool = MHAKVPool(num_pages, page_size, 1, hk, d, dtype=dtype, device=device)
    ref_q, ref_k = rotary(positions, q, k, (cos, sin))
    ref_pool.store(0, loc, ref_k, v)

    pool = MHAKVPool(num_pages, page_size, 1, hk, d, dtype=dtype, device=device)
    qkv_before = qkv.clone()
    out_q, out_k = rope_store_kv(q, k, v, cos, sin, pool.k_buffer[0], pool.v_buffer[0], loc, interleaved)
    assert torch.equal(qkv, qkv_before)  # inputs are read, never rotated in place
    assert rel_err(out_q, ref_q) < tol and rel_err(out_k, ref_k) < tol
    assert rel_err(pool.k_buffer[0], ref_pool.k_buffer[0]) < tol
    assert torch.equal(pool.v_buffer[0], ref_pool.v_buffer[0])  # v is copied, not computed
    untouched = torch.ones(pool.num_slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert not pool.k_buffer[0][untouched].any() and not pool.v_buffer[0][untouched].any()


def test_rope_store_rejects_mismatched_pool():
    from attnserve.ops.kernels.rope_store import rope_store_kv

    q, k, v = torch.ones(2, 4, 8), torch.ones(2, 2, 8), torch.ones(2, 2, 8)
    cos = sin = torch.ones(2, 4)
    with pytest.raises(ValueError, match="pool buffers"):
        rope_store_kv(q, k, v, cos, sin, torch.zeros(16, 1, 8), torch.zeros(16, 1, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("heads,rank,rope,interleaved", [
    (3, 24, 8, True),  # DeepSeek's interleaved pairs; a rank that is not a power of two
    (20, 32, 16, True),  # more heads than one program takes: two head blocks
    (2, 16, 8, False),  # half-split pairs
])
def test_mla_rope_matches_norm_rotate_and_concatenate(device, dtype, tol, heads, rank, rope, interleaved):
    from attnserve.ops.kernels.mla_rope import mla_rope

    tokens, nope = 5, 12
    rotary = RotaryEmbedding(rope, RopeConfig(theta=10000.0), 4096, interleaved=interleaved).to(device)
    positions = torch.tensor([0, 1, 7, 300, 2048], device=device)  # [T]
    cos, sin = rotary.cos_sin(positions, dtype)  # each [T, rope/2]
    q = _rand(tokens, heads, nope + rope, dtype=dtype, device=device, scale=2.0)  # [T, H, nope + rope]
    q_pe = q[..., nope:]  # a strided view, as the model splits its projection
    q_latent = _rand(tokens, heads, rank, dtype=dtype, device=device).transpose(0, 1).contiguous().transpose(0, 1)
    kv_a = _rand(tokens, rank + rope, dtype=dtype, device=device, scale=3.0)  # [T, rank + rope]
    latent, k_pe = kv_a.split([rank, rope], dim=-1)
    norm_w = _rand(rank, dtype=dtype, device=device) + 1.0  # [rank]

    ref_q_pe, ref_k_pe = rotary(positions, q_pe, k_pe.view(tokens, 1, rope), (cos, sin))
    ref_q = torch.cat((q_latent, ref_q_pe), dim=-1)  # [T, H, rank + rope]
    ref_row = torch.cat((reference.rmsnorm(latent, norm_w, 1e-6)[:, None], ref_k_pe), dim=-1)  # [T, 1, rank + rope]

    q_full, kv_row = mla_rope(q_latent, q_pe, latent, k_pe, norm_w, 1e-6, cos, sin, interleaved)
    assert q_full.shape == ref_q.shape and kv_row.shape == ref_row.shape
    assert torch.equal(q_full[..., :rank], q_latent)  # copied, not computed
    assert rel_err(q_full, ref_q) < tol
    assert rel_err(kv_row, ref_row) < tol


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("heads,nope,rank,rope,interleaved", [
    (3, 12, 24, 8, True),  # a rank that is not a power of two, nor a multiple of the program's block
    (2, 16, 160, 8, False),  # three latent blocks a head, half-split pairs
])
def test_mla_absorb_rope_matches_the_batched_gemm_then_mla_rope(device, dtype, tol, heads, nope, rank, rope,
                                                               interleaved):
    from attnserve.ops.kernels.mla_absorb import mla_absorb_rope
    from attnserve.ops.kernels.mla_rope import mla_rope

    tokens, v = 3, 8
    rotary = RotaryEmbedding(rope, RopeConfig(theta=10000.0), 4096, interleaved=interleaved).to(device)
    positions = torch.tensor([0, 9, 1500], device=device)  # [T]
    cos, sin = rotary.cos_sin(positions, dtype)  # each [T, rope/2]
    q = _rand(tokens, heads, nope + rope, dtype=dtype, device=device, scale=2.0)  # [T, H, nope + rope]
    q_nope, q_pe = q.split([nope, rope], dim=-1)  # strided views, as the model splits its projection
    kv_b = _rand(heads, nope + v, rank, dtype=dtype, device=device, scale=0.3)  # kv_b_proj's weight, per head
    w_uk = kv_b[:, :nope]  # [H, nope, rank], a view
    kv_a = _rand(tokens, rank + rope, dtype=dtype, device=device, scale=3.0)  # [T, rank + rope]
    latent, k_pe = kv_a.split([rank, rope], dim=-1)
    norm_w = _rand(rank, dtype=dtype, device=device) + 1.0  # [rank]

    q_latent = (q_nope.float().transpose(0, 1) @ w_uk.float()).transpose(0, 1).to(dtype)  # [T, H, rank]
    ref_q, ref_row = mla_rope(q_latent, q_pe, latent, k_pe, norm_w, 1e-6, cos, sin, interleaved)
    q_full, kv_row = mla_absorb_rope(q_nope, q_pe, w_uk, latent, k_pe, norm_w, 1e-6, cos, sin, interleaved)
    assert q_full.shape == ref_q.shape and kv_row.shape == ref_row.shape
    assert rel_err(q_full, ref_q) < tol
    assert torch.equal(q_full[..., rank:], ref_q[..., rank:])  # the rotation: the same arithmetic
    assert torch.equal(kv_row, ref_row)
    with pytest.raises(ValueError, match="must be"):
        mla_absorb_rope(q_nope, q_pe, w_uk[:, :-1], latent, k_pe, norm_w, 1e-6, cos, sin, interleaved)
    with pytest.raises(ValueError, match="disagree"):
        mla_absorb_rope(q_nope, q_pe, w_uk, latent[:, :-1], k_pe, norm_w, 1e-6, cos, sin, interleaved)


def test_mla_rope_rejects_mismatched_shapes():
    from attnserve.ops.kernels.mla_rope import mla_rope

    cos = sin = torch.ones(2, 4)
    with pytest.raises(ValueError, match="disagree"):
        mla_rope(torch.ones(2, 3, 16), torch.ones(2, 3, 8), torch.ones(2, 12), torch.ones(2, 8), torch.ones(16),
                 1e-6, cos, sin, True)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("experts,top_k,scoring,normalise,scale,hidden", [
    (64, 6, "softmax", False, 1.0, 300),  # DeepSeek-V2-Lite's router; logits split over three programs
    (8, 2, "softmax", True, 1.0, 80),  # Mixtral-style: renormalised top-2, one program a token
    (12, 3, "sigmoid", True, 2.5, 2100),  # experts not a power of two, sigmoid scores, a scaling factor; 16 programs
])
def test_greedy_routing_kernel_matches_the_router(device, dtype, tol, experts, top_k, scoring, normalise, scale,
                                                  hidden):
    from types import SimpleNamespace

    from attnserve.models.moe import Router
    from attnserve.ops.kernels.moe_route import route_greedy

    tokens = 7
    cfg = SimpleNamespace(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k, topk_method="greedy",
                          scoring_func=scoring, n_group=None, topk_group=None, norm_topk_prob=normalise,
                          routed_scaling_factor=scale)  # the fields a Router reads
    router = Router(cfg).to(device)
    router.weight.data = _rand(experts, hidden, dtype=torch.float32, device=device, scale=hidden ** -0.5)  # [E, hidden]
    # (logits of order 1: sigmoid scores far from saturating into ties)
    x = _rand(tokens, hidden, dtype=dtype, device=device)  # [T, hidden]
    want_w, want_ids = router(x)  # torch ops: the op set is TORCH_OPS
    got_w, got_ids = route_greedy(x, router.weight, top_k, scoring == "softmax", normalise, scale)
    again_w, again_ids = route_greedy(x, router.weight, top_k, scoring == "softmax", normalise, scale)
    assert torch.equal(again_w, got_w) and torch.equal(again_ids, got_ids)  # the tickets were reset, same bits
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.all(got_w[:, :-1] >= got_w[:, 1:])  # highest score first
    order = want_ids.sort(dim=1)  # torch.topk(sorted=False) names no order: compare by expert id
    got_order = got_ids.sort(dim=1)
    assert torch.equal(got_order.values, order.values)
    assert rel_err(got_w.gather(1, got_order.indices), want_w.gather(1, order.indices)) < 1e-5


def test_the_fused_ops_compile_for_sm90():
    """Compiled offline with Triton's ptxas, as the engine launches them (PDL on and off, the one-token MoE path):
    the interpreter accepts code the GPU compiler refuses. No spills; PDL's wait and release only where asked."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "tools/compile_ops_sm90.py"), "--json"], check=False,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 26
    for name, r in report.items():
        assert r["spill_bytes"] == [0, 0], (name, r)
        assert r["grid_dependency_control"] == (2 if name.endswith("+pdl") else 0), (name, r)
