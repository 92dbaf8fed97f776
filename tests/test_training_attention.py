"""attention.training on the CPU: gradcheck in float64 of the blockwise torch path and of the Triton kernels
(under TRITON_INTERPRET=1), gradients against autograd through the dense float64 formula on ragged shapes
(causal, sliding window, GQA, softcap, Tq != Tk), the row LSE, argument checks, and the O(T*d) memory of the
backward measured through torch's CPU memory profiler."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from attnserve.analysis.training import dense_attention, flash_attention, flash_attention_with_lse

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels run on the CPU only interpreted")
IMPLS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _inputs(b, hq, hk, tq, tk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, hk, tk, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, hk, tk, d, generator=g, dtype=dtype).requires_grad_()
    do = torch.randn(b, hq, tq, d, generator=g, dtype=dtype)
    return q, k, v, do


# (B, Hq, Hkv, Tq, Tk, D, causal, window, softcap): ragged lengths, none a multiple of the tiles
CASES = {
    "dense": (1, 2, 2, 37, 37, 16, False, None, None),
    "causal-gqa": (2, 4, 2, 37, 53, 16, True, None, None),
    "window-gqa": (1, 4, 1, 45, 45, 16, True, 7, None),
    "window-softcap": (1, 2, 2, 33, 70, 8, True, 20, 5.0),
    "window-noncausal": (1, 2, 1, 40, 29, 16, False, 9, None),
    "causal-long-keys": (1, 3, 1, 19, 83, 16, True, None, None),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_autograd_through_the_dense_formula(impl, case):
    b, hq, hk, tq, tk, d, causal, window, softcap = CASES[case]
    q, k, v, do = _inputs(b, hq, hk, tq, tk, d, seed=sorted(CASES).index(case))
    out = flash_attention(q, k, v, causal=causal, window=window, softcap=softcap, impl=impl)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = dense_attention(q, k, v, causal=causal, window=window, softcap=softcap)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11, msg=f"d{name}")


@needs_interpreter
@pytest.mark.parametrize("extra", [(2,), (1, 1), (2, 1), (1, 0, 1), (2, 1, 1)],
                         ids=["diagonal-split", "descriptors", "both", "fused-dq", "all"])
@pytest.mark.parametrize("case", ["causal-gqa", "causal-long-keys", "window-softcap", "window-noncausal"])
def test_backward_tile_variants(case, extra):
    # the fifth tile entry halves the step of the masked (diagonal, or windowed) blocks of dkdv and dq; the sixth
    # reads the loops' tiles through tensor descriptors (rows past the end as zeros, as the masked loads give); a
    # seventh on dkdv adds each block's dQ share into a float32 accumulator (element-wise atomics here, one TMA
    # reduction on a GPU) and launches no dq kernel. float32: TMA reductions add float32 at most
    from attnserve.analysis.training import kernels

    b, hq, hk, tq, tk, d, causal, window, softcap = CASES[case]
    q, k, v, do = (t.detach().float() for t in _inputs(b, hq, hk, tq, tk, d, seed=11))
    base = kernels.INTERPRETER_TILES
    split = kernels.Tiles(base.fwd, base.dkdv + extra, base.dq + extra[:2])
    o, lse = kernels.forward(q, k, v, causal, d ** -0.5, window, softcap)
    got = kernels.backward(do, q, k, v, o, lse, causal, d ** -0.5, window, softcap, split)
    x = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(dense_attention(*x, causal=causal, window=window, softcap=softcap), x, do.double())
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-5, msg=f"d{name}")


@needs_interpreter
def test_descriptors_are_dropped_where_tma_cannot_read_the_rows(monkeypatch):
    from attnserve.analysis.training import kernels

    q, k, v, do = (t.detach() for t in _inputs(1, 2, 1, 21, 21, 16, seed=2))
    launches = []
    real = kernels._launch_backward
    monkeypatch.setattr(kernels, "_launch_backward", lambda t: launches.append(real(t)) or launches[-1])
    tiles = kernels.Tiles(kernels.INTERPRETER_TILES.fwd, (16, 32, 4, 1, 1, 1), (32, 16, 4, 1, 1, 1))
    o, lse = kernels.forward(q, k, v, True, 0.25, None, None)
    kernels.backward(do, q, k, v, o, lse, True, 0.25, None, None, tiles)
    strided = torch.zeros(1, 2, 21, 17, dtype=q.dtype)[..., :16]  # rows of 17 doubles: not a 16-byte multiple
    strided.copy_(q)
    got = kernels.backward(do, strided, k, v, o, lse, True, 0.25, None, None, tiles)
    assert [x["DESC"] for x in launches] == [True, True, False, True]  # dkdv reads q; dq reads k and v
    want = kernels.backward(do, q, k, v, o, lse, True, 0.25, None, None, kernels.INTERPRETER_TILES)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck_float64(impl):
    # GQA (2 query heads per KV head), causal with more keys than queries, window and softcap in one call;
    # the interpreted kernels check the Jacobian along random directions (fast_mode), the torch path all of it
    q, k, v, _ = _inputs(1, 2, 1, 5, 7, 4)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, window=4, softcap=3.0, impl=impl)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=impl == "triton")


def test_gradcheck_float64_plain_causal_reference():
    q, k, v, _ = _inputs(2, 2, 2, 6, 6, 4, seed=3)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, impl="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_is_the_natural_log_row_logsumexp(impl):
    q, k, v, _ = _inputs(1, 2, 1, 21, 30, 16, seed=5)
    out, lse = flash_attention_with_lse(q, k, v, causal=True, sm_scale=0.3, impl=impl)
    s = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    visible = torch.arange(30)[None, :] <= torch.arange(21)[:, None] + 9
    want = torch.logsumexp(s.masked_fill(~visible, float("-inf")), dim=-1)
    assert lse.shape == (1, 2, 21) and not lse.requires_grad
    torch.testing.assert_close(lse, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_half_precision_with_float32_accumulation(impl):
    # float16 inputs (the interpreter's numpy has no bfloat16): within half-precision rounding of float64
    q, k, v, do = _inputs(1, 4, 2, 40, 40, 16, dtype=torch.float16, seed=7)
    out = flash_attention(q, k, v, causal=True, impl=impl)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    assert out.dtype == torch.float16 and all(g.dtype == torch.float16 for g in grads)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-3)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)


def test_default_impl_on_the_cpu():
    q, k, v, _ = _inputs(1, 1, 1, 3, 3, 4)
    # without CUDA the Triton kernels run only where the interpreter is asked for; both give the same answer
    torch.testing.assert_close(flash_attention(q, k, v), flash_attention(q, k, v, impl="torch"), rtol=0, atol=1e-14)


@pytest.mark.parametrize("kwargs, message", [
    (dict(hq=3, hk=2), "not a multiple"),
    (dict(tq=9, tk=8, causal=True), "at least as many keys"),
    (dict(window=0), "window"),
    (dict(softcap=-1.0), "softcap"),
    (dict(impl="cuda"), "impl"),
    (dict(d=12, impl="triton"), "power-of-two head_dim"),
])
def test_arguments_are_checked(kwargs, message):
    shape = dict(hq=2, hk=1, tq=4, tk=8, d=4)
    shape.update({n: kwargs.pop(n) for n in list(kwargs) if n in shape})
    q, k, v, _ = _inputs(1, shape["hq"], shape["hk"], shape["tq"], shape["tk"], shape["d"])
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, **kwargs)


# --------------------------------------------------------------------------- memory of the backward pass

def _backward_peak_bytes(out, inputs, do) -> int:
    """Peak bytes the CPU allocator holds during the backward, above what it held when the backward began,
    read from the memory events of torch's profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = torch.autograd.grad(out, inputs, do)
    del grads
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    assert totals, "the profiler recorded no allocation"
    first = next(e for e in events if e.get("name") == "[memory]")
    return max(totals) - (first["args"]["Total Allocated"] - first["args"]["Bytes"])


def _peak(impl, t, d=16):
    q, k, v, do = _inputs(1, 1, 1, t, t, d, dtype=torch.float32, seed=t)
    if impl == "dense":
        out = dense_attention(q, k, v, causal=True)
    else:
        out = flash_attention(q, k, v, causal=True, impl=impl)
    return _backward_peak_bytes(out, (q, k, v), do)


def test_the_measurement_sees_a_materialised_score_matrix():
    t = 512
    assert _peak("dense", t) >= t * t * 4  # the dense backward holds at least one T x T float32 matrix


def test_blockwise_backward_memory_is_linear_in_t():
    from attnserve.analysis.training.reference import REFERENCE_BLOCK

    small, big = _peak("torch", 1024), _peak("torch", 2048)
    assert big < 2048 * 2048 * 4 / 2  # well under one T x T float32 matrix
    assert big <= 2.1 * small  # doubling T doubles it: O(T), not O(T^2)
    # the gradients (3 T x d) and a few row blocks of scores (block x T) are all it holds
    assert big <= 4 * (3 * 2048 * 16 + 16 * REFERENCE_BLOCK * 2048)


@needs_interpreter
def test_triton_backward_allocates_only_the_gradients_and_two_row_vectors():
    t, d = 512, 16
    peak = _peak("triton", t, d)
    grads = 3 * t * d * 4  # dq, dk, dv in float32
    delta = t * 4  # rowsum(dO * O), one float per row
    assert grads <= peak <= grads + delta + 4096


def test_the_training_kernels_and_the_prefill_kernel_with_lse_compile_for_sm90():
    """Compiled offline with Triton's ptxas (the interpreter accepts code the GPU compiler refuses): the backward
    tile options build what they claim (TMA loads with descriptors, one TMA reduction a loop with fused dQ), and
    the prefill kernel writing the LSE keeps its warp specialisation and its registers."""
    import ast
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")

    def run(tool, *args):
        proc = subprocess.run([sys.executable, str(root / "tools" / tool), *args], check=False, capture_output=True,
                              text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()

    rows = {tuple(r["tile"]): r for r in map(json.loads, run("compile_training_sm90.py", "--json", "--tiles",
                                                              "dkdv:32,128,8,3", "dkdv:32,128,8,3,1,1",
                                                              "dkdv:32,128,8,3,1,0,1", "dq:128,64,8,3,1,1"))}
    assert all("error" not in r for r in rows.values()), rows
    plain, described, fused = rows[(32, 128, 8, 3)], rows[(32, 128, 8, 3, 1, 1)], rows[(32, 128, 8, 3, 1, 0, 1)]
    assert plain["tma_loads"] == 0 and plain["tma_reductions"] == 0
    assert described["tma_loads"] > 0 and rows[(128, 64, 8, 3, 1, 1)]["tma_loads"] > 0
    assert fused["tma_reductions"] == 2  # one in the diagonal's loop, one in the full blocks' loop
    assert rows[(128, 64, 8, 3, 1, 1)]["spill_bytes"] == [0, 0]  # dq's K and V through TMA: no spills

    out = [ast.literal_eval(line) for line in run("compile_prefill_tma_sm90.py", "--configs", "128,128,4,2,1,1,0,1",
                                                  "--lse", "--group", "1")]
    plain, with_lse = (r for r in out if not r["lse"]), (r for r in out if r["lse"])
    plain, with_lse = next(plain), next(with_lse)
    assert with_lse["warp_specialized"] and with_lse["warps"] == 12
    assert with_lse["registers"] == plain["registers"] and with_lse["spill_bytes"] == 0
