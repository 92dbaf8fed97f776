"""FlashInfer backend against the oracle on randomized ragged paged batches (GPU), and its CPU-side contract.

GPU test names group the FlashInfer kernels they compile (base = fa2 + decode, fa3, window, fp8),
so the JIT builds can run in separate processes at once.
"""

import random
import sys
from dataclasses import replace

import pytest
import torch

from attnserve._lazy import is_installed
from attnserve.attention.backends.flex import FlexAttentionBackend
from attnserve.attention.base import AttentionRequirements, unsupported
from attnserve.attention.hybrid import HybridAttentionBackend
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool, get_spec
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not is_installed("flashinfer"), reason="needs CUDA and flashinfer")
HQ, HKV, DIM = 16, 4, 128


# ---- CPU ---------------------------------------------------------------------------------------------------
def test_features_are_read_without_importing_flashinfer():
    feats = get_spec("flashinfer").features
    assert feats.cuda_graph and feats.custom_mask and "flashinfer" in feats.required_packages
    assert unsupported(feats, AttentionRequirements(attention_sinks=True)) == ["no attention sinks"]
    assert unsupported(feats, AttentionRequirements(attention_type="MLA", head_dim=576, v_head_dim=512)) == []


def test_missing_flashinfer_names_the_install_command(monkeypatch):

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # importing it now fails, installed or not

    sb = make_batch([3], [2], head_dim=64)
    with pytest.raises(ImportError, match="pip install"):
        backend_for_pool("flashinfer", sb.pool)


# ---- GPU ---------------------------------------------------------------------------------------------------
def _ragged(seed: int, bs: int, decode: bool, max_prefix: int = 300, max_ext: int = 160):
    rng = random.Random(seed)
    prefix = [rng.randint(1 if decode else 0, max_prefix) for _ in range(bs)]
    ext = [1] * bs if decode else [rng.randint(1, max_ext) for _ in range(bs)]
    return prefix, ext


def _check(sb, backend, tol=1e-2):
    meta = backend.plan(sb.fb)
    out = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < tol, f"relative error {rel:.3g}"
    return out


def _batch(seed, decode, page_size, **kw):
    prefix, ext = _ragged(seed, 1 + seed % 7, decode)
    return make_batch(prefix, ext, num_heads=HQ, num_kv_heads=HKV, head_dim=DIM, page_size=page_size,
                      dtype=torch.bfloat16, device="cuda", seed=seed, score_scale=4.0, **kw)


def _backend(sb, **kw):

    return backend_for_pool("flashinfer", sb.pool, workspace_mb=64, **kw)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_base_decode(page_size, seed):
    sb = _batch(seed, True, page_size)
    _check(sb, _backend(sb))


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("path", ["paged", "ragged"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_base_extend_fa2(path, page_size, seed):
    sb = _batch(seed + 10, False, page_size)
    backend = _backend(sb, prefill_kernel="fa2", prefill_path=path)
    assert backend.prefill_kernel == "fa2"
    _check(sb, backend)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_base_verify_custom_mask(page_size):
    prefix, ext = [37, 5, 120], [4, 7, 3]
    sb = make_batch(prefix, ext, num_heads=HQ, num_kv_heads=HKV, head_dim=DIM, page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", custom_mask=True, mode=ForwardMode.TARGET_VERIFY)
    _check(sb, _backend(sb))


@pytest.mark.gpu
@needs_flashinfer
def test_base_hybrid_with_flex_decode():

    sb = _batch(21, False, 16)
    hybrid = HybridAttentionBackend(_backend(sb, prefill_kernel="fa2"), FlexAttentionBackend(sb.pool, compile=False))
    _check(sb, hybrid)
    assert hybrid.backend_for(sb.fb.mode).name == "flashinfer"


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_base_decode_cuda_graph(page_size):
    """Capture at batch 4, replay a step with other requests and lengths: the output follows."""
    prefix = [90, 3, 250, 41]
    sb = make_batch(prefix, [1] * 4, num_heads=HQ, num_kv_heads=HKV, head_dim=DIM, page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", seed=5)
    backend = _backend(sb)
    _check(sb, backend)  # eager warm-up: the layer signature becomes known
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    meta = backend.plan_for_capture(sb.fb)
    q_static = sb.q.clone()  # [4, HQ, DIM]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.forward(q_static, None, None, sb.layer, sb.fb, meta)
    # next step: rows in another order and shorter, over KV already in the pool (rows 1..4 hold 91/4/251/42)
    rows, new_prefix = [3, 1, 4, 2], [200, 50, 30, 2]
    fb2 = ForwardBatch.from_lengths(ForwardMode.DECODE, rows, new_prefix, [1] * 4, sb.fb.req_to_token, sb.pool)
    q_static.copy_(torch.randn_like(q_static) * 4)
    meta = backend.plan_for_replay(fb2)
    graph.replay()
    ref = reference_for_batch(q_static, sb.layer, fb2, compute_dtype=torch.float32)
    rel = ((out_static.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"replayed graph: relative error {rel:.3g}"
    eager = _check(_rebind(sb, fb2, q_static), _backend(sb))
    assert torch.allclose(eager.float(), out_static.float(), atol=2e-2, rtol=2e-2)


def _rebind(sb, fb, q):

    return replace(sb, fb=fb, q=q, k=None, v=None)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("path", ["paged", "ragged"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(2))
def test_fa3_extend_auto(path, page_size, seed):
    sb = _batch(seed + 30, False, page_size)
    backend = _backend(sb, prefill_path=path)
    major = torch.cuda.get_device_capability()[0]
    assert backend.prefill_kernel == ("fa3" if major == 9 else "fa2"), backend.prefill_kernel_reason
    _check(sb, backend)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_window_softcap(decode, page_size):
    sb = _batch(40 + page_size, decode, page_size, sliding_window=37, logit_cap=6.0)
    _check(sb, _backend(sb, prefill_kernel="fa2"))


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_kv(decode, page_size):
    sb = _batch(50 + page_size, decode, page_size, kv_dtype="fp8_e4m3")
    backend = _backend(sb)
    assert backend.prefill_kernel == "fa2"
    _check(sb, backend, tol=2e-2)


# ---- MLA: BatchMLAPagedAttentionWrapper (test names start with mla: their own JIT builds) -------------------
def _mla_batch(seed, decode, page_size, heads=16):
    prefix, ext = _ragged(seed, 1 + seed % 5, decode)
    return make_batch(prefix, ext, num_heads=heads, mla=(512, 64), page_size=page_size, dtype=torch.bfloat16,
                      device="cuda", seed=seed, score_scale=2.0)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_decode_and_extend(kernel, decode, page_size):
    if kernel == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's fa3 MLA kernel is SM90 only")
    sb = _mla_batch(40 + page_size, decode, page_size)
    backend = _backend(sb, mla_kernel=kernel)
    assert backend.kernel == kernel
    _check(sb, backend)


@pytest.mark.gpu
@needs_flashinfer
def test_mla_decode_cuda_graph():
    """Capture at batch 4 on the latent pool, replay other lengths: the output follows."""
    sb = make_batch([90, 3, 250, 41], [1] * 4, num_heads=16, mla=(512, 64), page_size=1, dtype=torch.bfloat16,
                    device="cuda", seed=5, score_scale=2.0)
    backend = _backend(sb)
    _check(sb, backend)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    meta = backend.plan_for_capture(sb.fb)
    q_static = sb.q.clone()  # [4, 16, 576]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.forward(q_static, None, None, sb.layer, sb.fb, meta)
    fb2 = ForwardBatch.from_lengths(ForwardMode.DECODE, [3, 1, 4, 2], [200, 50, 30, 2], [1] * 4,
                                    sb.fb.req_to_token, sb.pool)
    q_static.copy_(torch.randn_like(q_static) * 2)
    meta = backend.plan_for_replay(fb2)
    graph.replay()
    ref = reference_for_batch(q_static, sb.layer, fb2, compute_dtype=torch.float32)
    rel = ((out_static.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"replayed graph: relative error {rel:.3g}"


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("decode", [True, False])
def test_mla_fp8_latent_on_hopper(decode):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer reads FP8 MLA latents on SM90 only (the backend refuses elsewhere)")
    prefix, ext = _ragged(7, 4, decode)
    sb = make_batch(prefix, ext, num_heads=16, mla=(512, 64), page_size=64, dtype=torch.bfloat16,
                    kv_dtype="fp8_e4m3", device="cuda", seed=7, score_scale=2.0)
    _check(sb, _backend(sb))  # the oracle dequantises the same FP8 latent with the pool's scale


@pytest.mark.gpu
@needs_flashinfer
def test_mla_hybrid_with_triton_decode():
    """DeepSeek's pick on an H200: FlashInfer MLA prefill, triton MLA decode, over one latent pool."""

    sb = _mla_batch(11, False, 64)
    hybrid = HybridAttentionBackend(_backend(sb), backend_for_pool("triton", sb.pool))
    _check(sb, hybrid)
    rows = sb.fb.req_pool_indices.tolist()
    fb = ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [s - 1 for s in sb.fb.seq_lens_cpu], [1] * len(rows),
                                   sb.fb.req_to_token, sb.pool)
    q = torch.randn(len(rows), 16, 576, device="cuda", dtype=torch.bfloat16) * 2  # [B, H, rank + rope]
    meta = hybrid.plan(fb)
    out = hybrid.forward(q, None, None, sb.layer, fb, meta)
    ref = reference_for_batch(q, sb.layer, fb, compute_dtype=torch.float32)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
