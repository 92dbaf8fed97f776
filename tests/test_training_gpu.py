"""attention.training's Triton kernels on a CUDA device: bf16/fp16 gradients against autograd through the
dense float64 formula (causal, sliding window, GQA, ragged lengths, head dims 64 and 128; [B, H, T, D] tensors
and [B, T, H, D] ones viewed per head, the two layouts the causal forward reads through the prefill kernel), and
the peak memory of the backward at T = 8192, which must stay O(T*d)."""

from __future__ import annotations

import pytest
import torch

from attnserve.analysis.training import dense_attention, flash_attention

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [gpu, needs_cuda]

# (B, Hq, Hkv, Tq, Tk, D, causal, window, softcap)
CASES = [
    (2, 8, 8, 1000, 1000, 128, True, None, None),
    (1, 8, 2, 777, 1537, 128, True, None, None),
    (1, 16, 4, 1200, 1200, 64, True, 256, None),
    (3, 4, 1, 515, 515, 64, False, None, None),
    (1, 8, 8, 640, 900, 128, True, 300, 30.0),
    (2, 6, 2, 333, 211, 128, False, None, None),
]


def _tensor(b, h, t, d, dtype, layout, g):
    """[B, H, T, D] stored as is ("heads") or as a [B, T, H, D] tensor viewed per head ("tokens"): the causal
    forward reads both in place through the prefill kernel (analysis.training.forward_tma)."""
    if layout == "heads":
        return torch.randn(b, h, t, d, device="cuda", generator=g, dtype=dtype)
    return torch.randn(b, t, h, d, device="cuda", generator=g, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("layout", ["heads", "tokens"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_gradients_within_half_precision_of_float64(case, dtype, layout):
    b, hq, hk, tq, tk, d, causal, window, softcap = case
    g = torch.Generator(device="cuda").manual_seed(CASES.index(case))
    q, k, v = (_tensor(b, h, t, d, dtype, layout, g).requires_grad_() for h, t in ((hq, tq), (hk, tk), (hk, tk)))
    do = torch.randn(b, hq, tq, d, device="cuda", generator=g, dtype=dtype)
    kw = dict(causal=causal, window=window, softcap=softcap)
    out = flash_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # the float64 oracle, and the same dense formula run in the half dtype: our error must be comparable
    # to the rounding error of the plain formula in that dtype (the FlashAttention test convention)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*x64, **kw)
    ref_grads = torch.autograd.grad(ref, x64, do.double())
    xh = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    half = dense_attention(*xh, **kw)
    half_grads = torch.autograd.grad(half, xh, do)
    assert (out.double() - ref).abs().max() <= 2 * (half.double() - ref).abs().max() + 1e-3
    for name, got, hg, want in zip("qkv", grads, half_grads, ref_grads):
        assert got.dtype == dtype and got.shape == want.shape
        err, half_err = (got.double() - want).abs().max(), (hg.double() - want).abs().max()
        assert err <= 2 * half_err + 1e-3, f"d{name}: {err:.3g} vs the half-precision formula's {half_err:.3g}"


def test_backward_peak_memory_is_linear_at_8k():
    b, h, t, d = 1, 16, 8192, 128
    q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flash_attention(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # tuned and compiled: no one-off buffers below
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    td = b * h * t * d * 2  # one bf16 [B, H, T, D] tensor: 32 MiB
    score_matrix = b * h * t * t * 2  # what a bf16 S (or P) of every head would take: 2 GiB
    assert extra <= 3 * td + 2 * b * h * t * 4 + (1 << 20), (extra, td)  # dq, dk, dv, delta (+ allocator slack)
    assert extra < score_matrix / 10
    del grads


# the backward tile variants the sweep races (kernels.Tiles): the diagonal in half steps, TMA descriptor loads, and
# dQ fused into the dkdv kernel through TMA reductions, which only the GPU runs (the interpreter adds element-wise)
VARIANTS = {"diagonal-split": ((32, 128, 8, 3, 2), (128, 64, 8, 3, 2)),
            "descriptors": ((32, 128, 8, 3, 1, 1), (128, 64, 8, 3, 1, 1)),
            "fused-dq": ((32, 128, 8, 3, 1, 0, 1), (128, 64, 8, 3)),
            "fused-dq-descriptors-split": ((32, 128, 8, 2, 2, 1, 1), (128, 64, 8, 3))}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4], CASES[5]], ids=["c1", "c2", "c4", "c5"])
def test_backward_tile_variants_match_the_default(case, variant):
    from attnserve.analysis.training import kernels

    b, hq, hk, tq, tk, d, causal, window, softcap = case
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(b, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
                   for h, t in ((hq, tq), (hk, tk), (hk, tk), (hq, tq)))
    scale = d ** -0.5
    o, lse = kernels.forward(q, k, v, causal, scale, window, softcap)
    base = kernels.tiles_for(d)
    dkdv, dq = VARIANTS[variant]
    if d != 128:  # the head-dim-64 tiles, with the variant's extra entries
        dkdv, dq = base.dkdv + dkdv[4:], base.dq + dq[4:]
    want = kernels.backward(do, q, k, v, o, lse, causal, scale, window, softcap, base)
    got = kernels.backward(do, q, k, v, o, lse, causal, scale, window, softcap, kernels.Tiles(base.fwd, dkdv, dq))
    for name, x, y in zip("qkv", got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert ((x.float() - y.float()).abs().max() / y.float().abs().max()).item() < 1e-2, f"d{name}"
