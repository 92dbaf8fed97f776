"""The training forward through the serving prefill kernel (analysis.training.forward_tma) under
TRITON_INTERPRET=1: O and the row LSE against the float64 blockwise forward in both layouts it reads in place
(GQA, Tq != Tk, sliding window, softcap, lengths no multiple of the tiles), both work-list orders, what falls back
to the blocked kernel, and the LSE the prefill kernel writes for the serving call."""

from __future__ import annotations

import os

import pytest
import torch

from attnserve.analysis.training import forward_tma, kernels
from attnserve.analysis.training.reference import blockwise_forward

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels run on the CPU only interpreted")

# (B, Hq, Hkv, Tq, Tk, D, window, softcap)
CASES = {
    "mha": (2, 2, 2, 40, 40, 64, None, None),
    "gqa-long-keys": (1, 4, 1, 33, 70, 64, None, None),
    "window": (2, 2, 1, 50, 50, 64, 17, None),
    "window-softcap": (1, 2, 2, 37, 45, 128, 9, 5.0),
}


def _make(b, h, t, d, layout, gen):
    """[B, H, T, D] bf16 stored heads-major or tokens-major (a [B, T, H, D] tensor viewed per head)."""
    if layout == "heads":
        return torch.randn(b, h, t, d, generator=gen).bfloat16()
    return torch.randn(b, t, h, d, generator=gen).bfloat16().transpose(1, 2)


def _inputs(case, layout, seed=0):
    b, hq, hk, tq, tk, d, window, softcap = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q, k, v = _make(b, hq, tq, d, layout, g), _make(b, hk, tk, d, layout, g), _make(b, hk, tk, d, layout, g)
    return q, k, v, d ** -0.5, window, softcap


@pytest.mark.parametrize("order", forward_tma.ORDERS)
@pytest.mark.parametrize("layout", ["heads", "tokens"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_output_and_lse_match_the_float64_forward(case, layout, order):
    q, k, v, scale, window, softcap = _inputs(case, layout)
    assert forward_tma.layout(q, k, v) == layout
    choice = forward_tma.TmaForward(forward_tma.INTERPRETER_TMA_FORWARD.config, order)
    o, lse = kernels.forward(q, k, v, True, scale, window, softcap, tma=choice)
    want_o, want_lse = blockwise_forward(q.double(), k.double(), v.double(), True, scale, window, softcap)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and o.stride() == q.stride()  # q's layout kept
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()  # what backward reads
    # bf16 output: a rounding of values up to ~4 is 2^-6; the LSE is float32 throughout
    assert (o.double() - want_o).abs().max() < 2 ** -5
    assert (lse.double() - want_lse).abs().max() < 1e-4


def test_the_default_takes_the_prefill_kernel_for_a_causal_bf16_forward(monkeypatch):
    q, k, v, scale, window, softcap = _inputs("gqa-long-keys", "heads")
    calls = []
    real = forward_tma.forward_tma
    monkeypatch.setattr(forward_tma, "forward_tma", lambda *a: calls.append(a) or real(*a))
    kernels.forward(q, k, v, True, scale, window, softcap)
    assert len(calls) == 1
    kernels.forward(q, k, v, True, scale, window, softcap, tma=None)  # the blocked kernel asked for
    kernels.forward(q, k, v, False, scale, window, softcap)  # not causal: the prefill kernel is causal only
    kernels.forward(q.float(), k.float(), v.float(), True, scale, window, softcap)  # float32
    assert len(calls) == 1


def test_layouts_it_cannot_read_in_place_fall_back():
    q, k, v, *_ = _inputs("mha", "heads")
    assert forward_tma.layout(q, k, v) == "heads"
    assert forward_tma.layout(q, k.transpose(1, 2).contiguous().transpose(1, 2), v) is None  # mixed layouts
    assert forward_tma.layout(q[:, :, ::2], k, v) is None  # strided rows
    choice = forward_tma.INTERPRETER_TMA_FORWARD
    assert forward_tma.applicable_layout(q, k, v, True, choice) == "heads"
    assert forward_tma.applicable_layout(q[:, :, ::2], k, v, True, choice) is None
    assert forward_tma.applicable_layout(q[..., :32], k[..., :32], v[..., :32], True, choice) is None  # head dim
    assert forward_tma.applicable_layout(q, k, v, False, choice) is None  # the prefill kernel is causal only
    with pytest.raises(ValueError, match="heads-major or all tokens-major"):
        forward_tma.forward_tma(q[:, :, ::2], k, v, 1.0, None, None, choice)
    with pytest.raises(ValueError, match="order"):
        forward_tma.TmaForward(choice.config, "diagonal")


def test_work_lists_cover_every_tile_once_in_their_order():
    tiles, qo_indptr, kv_starts, seq_lens = forward_tma._work(6, (3, 1), 40, 50, 16, "head_by_head", torch.device("cpu"))
    pairs = list(zip(tiles.tile_req.tolist(), tiles.tile_m0.tolist()))
    assert sorted(pairs) == sorted((r, m0) for r in range(6) for m0 in (0, 16, 32))
    assert pairs[:3] == [(0, 32), (0, 16), (0, 0)]  # one request's tiles in turn, the heaviest first
    assert kv_starts.tolist() == [0, 0, 0, 50, 50, 50]  # batch b's three query heads share its one KV head
    assert qo_indptr.tolist() == [0, 40, 80, 120, 160, 200, 240] and seq_lens.tolist() == [50] * 6
    fastest, *_ = forward_tma._work(6, (3, 1), 40, 50, 16, "heads_fastest", torch.device("cpu"))
    assert fastest.tile_req.tolist()[:6] == list(range(6)) and set(fastest.tile_m0.tolist()[:6]) == {32}


def test_the_serving_call_checks_the_lse_it_is_given():
    from attnserve.attention.kernels.mha.prefill_tma import prefill_tma_attention

    q, k, v, scale, *_ = _inputs("mha", "tokens")
    rows = [forward_tma._rows(t, "tokens") for t in (q, k, v)]
    tiles, qo_indptr, kv_starts, seq_lens = forward_tma._work(2, (1, 1), 40, 40, 16, "heads_fastest",
                                                              torch.device("cpu"))
    out = torch.empty_like(rows[0])
    from attnserve.attention.kernels.params import LayerParams

    with pytest.raises(ValueError, match="lse must be"):
        prefill_tma_attention(*rows, kv_starts, out, tiles, qo_indptr, seq_lens, LayerParams(scale),
                              config=forward_tma.INTERPRETER_TMA_FORWARD.config, lse=torch.empty(80, 3))
    lse = torch.empty(80, 2)
    prefill_tma_attention(*rows, kv_starts, out, tiles, qo_indptr, seq_lens, LayerParams(scale),
                          config=forward_tma.INTERPRETER_TMA_FORWARD.config, lse=lse)
    _, want = blockwise_forward(q.double(), k.double(), v.double(), True, scale, None, None)
    assert (lse.view(2, 40, 2).transpose(1, 2).double() - want).abs().max() < 1e-4


@pytest.mark.parametrize("layout", ["heads", "tokens"])
def test_gradients_through_the_prefill_forward_within_half_precision(layout):
    # fp16 (the interpreter's dot reads bf16 wrongly in the blocked backward): the prefill kernel's O and LSE feed
    # the blocked backward, whose gradients must stay within half-precision rounding of float64
    from attnserve.analysis.training import dense_attention, flash_attention

    b, hq, hk, tq, tk, d, window, softcap = CASES["gqa-long-keys"]
    g = torch.Generator().manual_seed(3)
    q, k, v = (_make(b, h, t, d, layout, g).half().requires_grad_() for h, t in ((hq, tq), (hk, tk), (hk, tk)))
    do = torch.randn(b, hq, tq, d, generator=g).half()
    assert forward_tma.applicable_layout(q, k, v, True, forward_tma.default_tma_forward(d, q.device)) == layout
    out = flash_attention(q, k, v, causal=True, impl="triton")
    grads = torch.autograd.grad(out, (q, k, v), do)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*x64, causal=True)
    ref_grads = torch.autograd.grad(ref, x64, do.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-3)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.dtype == torch.float16 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2, msg=f"d{name}")
