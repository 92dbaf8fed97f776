"""The fa4 backend: its contract and selection on the CPU (over a stand-in FA4), and FA4 itself on a GPU.

The stand-in `flash_attn.cute.interface` implements `flash_attn_varlen_func` with FA4's documented
semantics (packed rows by cu_seqlens, or a `[num_pages, page_size, kv_heads, d]` cache read through
`page_table` up to `seqused_k`, the causal mask aligned to the end of each request's KV, a left window
that does not count the query, soft-capping) in plain PyTorch. So the CPU tests check what the backend
hands FA4; the GPU tests check FA4's kernels against the float32 oracle.
"""

import math
import random
import sys
import types

import pytest
import torch

from attnserve._lazy import is_installed
from attnserve.attention.backends import fa4 as fa4_mod
from attnserve.attention.backends.fa4 import FA4Backend, call_varlen, paged_args
from attnserve.attention.base import AttentionRequirements, unsupported
from attnserve.batch import ForwardMode
from attnserve.choice.registry import REGISTRY, availability, get_spec
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE, detect_hardware
from attnserve.reference.attention import attend, reference_for_batch
from attnserve.reference.synthetic import make_batch
from attnserve.shape import GENERIC_GQA

H200, B200, A100 = (PRESET_HARDWARE[n] for n in ("h200", "b200", "a100"))


# ---- the stand-in FA4 ---------------------------------------------------------------------------------------
def _standin_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                    softcap=0.0, learnable_sink=None, return_lse=False):
    assert q.dtype == k.dtype == v.dtype, "FA4 takes q, k and v in one dtype"
    assert cu_seqlens_q.dtype == torch.int32
    bs = cu_seqlens_q.numel() - 1
    if page_table is not None:
        assert cu_seqlens_k is None and seqused_k is not None and page_table.dtype == torch.int32
        assert page_table.shape[0] == bs and page_table.is_contiguous()
        ps = k.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    left = window_size[0]
    for b in range(bs):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if page_table is None:
            k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            kb, vb = k[k0:k1], v[k0:k1]
        else:
            n = int(seqused_k[b])
            pos = torch.arange(n)
            pages = page_table[b, pos // ps].long()
            kb, vb = k[pages, pos % ps], v[pages, pos % ps]
        m, n = q1 - q0, kb.shape[0]
        qpos = torch.arange(m) + (n - m)  # the causal mask is aligned to the end of the KV
        kpos = torch.arange(n)
        mask = kpos[None, :] <= qpos[:, None] if causal else torch.ones(m, n, dtype=torch.bool)
        if left is not None:
            mask = mask & (kpos[None, :] >= qpos[:, None] - left)
        out[q0:q1] = attend(q[q0:q1].double(), kb.double(), vb.double(), mask, softmax_scale,
                            softcap or None).to(q.dtype)
    return out, None


@pytest.fixture
def standin(monkeypatch):
    """`flash_attn.cute.interface` as the stand-in; returns the list of calls' keyword names."""
    calls = []

    def varlen(*args, **kw):
        calls.append(sorted(kw))
        return _standin_varlen(*args, **kw)

    varlen.__signature__ = __import__("inspect").signature(_standin_varlen)
    interface = types.ModuleType(fa4_mod.FA4_MODULE)
    interface.flash_attn_varlen_func = varlen
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fa4_mod.FA4_MODULE, interface)
    return calls


def _run(sb, backend):
    meta = backend.plan(sb.fb)
    return backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# ---- the contract, as data ---------------------------------------------------------------------------------
def test_registry_lists_fa4_as_implemented_and_reads_features_without_flash_attn():
    spec = REGISTRY["fa4"]
    assert spec.implemented and get_spec("FA4") is spec
    feats = spec.features
    assert "flash_attn" not in sys.modules or not hasattr(sys.modules["flash_attn"], "cute")
    assert feats is FA4Backend.features and feats.prefill and not feats.decode
    assert feats.compute_capabilities == (9, 10) and feats.required_packages == ("flash_attn.cute",)


@pytest.mark.parametrize("req,reason", [
    (AttentionRequirements(attention_type="MLA", head_dim=576, v_head_dim=512, needs_decode=False), "no MLA attention"),
    (AttentionRequirements(kv_dtype="fp8_e4m3", needs_decode=False), "KV dtype fp8_e4m3 unsupported"),
    (AttentionRequirements(head_dim=256, needs_decode=False), "head_dim 256 unsupported"),
    (AttentionRequirements(custom_mask=True, needs_decode=False), "no custom attention masks"),
    (AttentionRequirements(attention_sinks=True, needs_decode=False), "no attention sinks"),
    (AttentionRequirements(spec_topk=1, needs_decode=False), "no speculative decoding"),
    (AttentionRequirements(needs_prefill=False), "prefill only"),
])
def test_feature_declarations_refuse_what_fa4_cannot_run(req, reason):
    assert reason in "; ".join(unsupported(FA4Backend.features, req))


def test_feature_declarations_accept_what_the_backend_runs():
    feats = FA4Backend.features
    for req in (AttentionRequirements(needs_decode=False, page_size=ps, head_dim=d, kv_dtype=dt)
                for ps in (1, 16, 128) for d in (64, 128) for dt in ("bf16", "fp16")):
        assert unsupported(feats, req) == [], req
    assert unsupported(feats, AttentionRequirements(head_dim=128, v_head_dim=64, sliding_window=True,
                                                    logit_softcap=True, needs_decode=False)) == []


# ---- refusals and selection --------------------------------------------------------------------------------
def test_refusal_reasons_on_this_machine():
    hw = detect_hardware()
    reasons = availability("fa4", hw)
    if hw.device != "cuda":
        assert any(r.startswith("needs CUDA") for r in reasons), reasons
    elif hw.compute_capability[0] not in (9, 10):
        assert any("needs SM90 (Hopper) or SM100 (Blackwell)" in r for r in reasons), reasons
    assert ("package 'flash_attn.cute' is not installed" in reasons) == (not is_installed("flash_attn.cute"))
    if reasons:  # an explicit choice that cannot run fails naming why
        with pytest.raises(ValueError, match="attention backend 'fa4' cannot serve prefill here") as info:
            select_backends(hw, GENERIC_GQA, prefill_backend="fa4")
        assert all(r in str(info.value) for r in reasons)


@pytest.mark.parametrize("hw,kw,words", [
    (A100, {"prefill_backend": "fa4"}, "needs SM90 (Hopper) or SM100 (Blackwell), this GPU is sm80"),
    (H200.__class__(**{**H200.__dict__, "installed": frozenset({"torch"})}), {"prefill_backend": "fa4"},
     "package 'flash_attn.cute' is not installed"),
    (H200, {"attention_backend": "fa4"}, "cannot serve decode here: prefill only"),
    (H200, {"decode_backend": "fa4"}, "prefill only"),
])
def test_explicit_fa4_that_cannot_run_fails_with_the_reason(hw, kw, words):
    with pytest.raises(ValueError, match="Backends that would") as info:
        select_backends(hw, GENERIC_GQA, **kw)
    assert words in str(info.value)


def test_fa4_prefill_on_hopper_pairs_with_a_decode_backend_at_its_native_page():
    sel = select_backends(H200, GENERIC_GQA, prefill_backend="fa4")
    assert sel.prefill_backend == "fa4" and sel.decode_backend != "fa4" and sel.page_size == 128
    sel = select_backends(H200, GENERIC_GQA, ServingFeatures(page_size=16), prefill_backend="fa4")
    assert sel.page_size == 16  # every page size runs (cp.async gather); 128 only when none is set
    # what SGLang would do keeps SGLang's fa4: Blackwell only, page 128
    with pytest.raises(ValueError, match="SM100"):
        select_backends(H200, GENERIC_GQA, prefill_backend="fa4", sglang=True)
    with pytest.raises(ValueError, match="page size 16 unsupported"):
        select_backends(B200, GENERIC_GQA, ServingFeatures(page_size=16), prefill_backend="fa4", sglang=True)


def test_missing_flash_attn_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, fa4_mod.FA4_MODULE, None)
    sb = make_batch([3], [2], head_dim=64)
    with pytest.raises(ImportError, match="pip install flash-attn-4"):
        FA4Backend(sb.pool)


# ---- plumbing over the stand-in ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prefix", [[0, 0, 0], [5, 0, 37]])
@pytest.mark.parametrize("layer_kw", [{}, {"sliding_window": 9, "logit_cap": 5.0}, {"v_head_dim": 32}])
def test_matches_the_oracle_through_the_standin(standin, page_size, prefix, layer_kw):
    sb = make_batch(prefix, [7, 12, 3], num_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size,
                    seed=page_size, score_scale=3.0, **layer_kw)
    backend = FA4Backend(sb.pool)
    step = backend.plan(sb.fb)
    out = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, step)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float64)
    assert out.shape == ref.shape and _rel(out, ref) < 1e-5
    ragged = not any(prefix)
    assert step.extend_path.startswith("ragged" if ragged else "paged")
    assert ("page_table" in standin[-1]) == (not ragged) and ("cu_seqlens_k" in standin[-1]) == ragged


def test_page_table_holds_page_ids_and_zeros_past_each_request(standin):
    sb = make_batch([5, 30], [3, 2], page_size=4, seed=3)
    pa = paged_args(sb.fb, 4)
    assert pa.page_table.dtype == torch.int32 and pa.page_table.shape == (2, 8)
    assert pa.seqused_k.tolist() == [8, 32] and pa.cu_seqlens_q.tolist() == [0, 3, 5]
    assert (pa.max_seqlen_q, pa.max_seqlen_k) == (3, 32)
    rows = sb.fb.req_to_token[sb.fb.req_pool_indices.long()]
    assert pa.page_table[0, :2].tolist() == (rows[0, [0, 4]] // 4).tolist()
    assert pa.page_table[0, 2:].tolist() == [0] * 6  # past request 0's 2 pages
    assert pa.page_table[1].tolist() == (rows[1, ::4][:8] // 4).tolist()


def test_refuses_custom_masks_mla_fp8_and_decode(standin):
    sb = make_batch([4], [3], custom_mask=True, mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="custom attention masks"):
        FA4Backend(sb.pool).plan(sb.fb)
    with pytest.raises(ValueError, match="MHA/GQA pools"):
        FA4Backend(make_batch([2], [1], mla=(32, 16)).pool)
    with pytest.raises(ValueError, match="FP8"):
        FA4Backend(make_batch([2], [1], kv_dtype="fp8_e4m3").pool)
    sb = make_batch([6, 3], [1, 1])
    backend = FA4Backend(sb.pool)
    with pytest.raises(NotImplementedError, match="decode backend"):
        _run(sb, backend)


def test_call_varlen_passes_only_what_this_fa4_takes():
    seen = {}

    def old_fa4(q, k, v, cu_seqlens_q=None, page_table=None, softmax_scale=None, causal=False):
        seen.update(cu_seqlens_q=cu_seqlens_q, page_table=page_table, causal=causal)
        return q, None

    q = torch.zeros(2, 1, 8)
    assert call_varlen(old_fa4, q, q, q, cu_seqlens_q=1, causal=True, window_size=(None, None), softcap=0.0) is q
    assert seen == {"cu_seqlens_q": 1, "page_table": None, "causal": True}
    with pytest.raises(RuntimeError, match="no seqused_k argument"):
        call_varlen(old_fa4, q, q, q, seqused_k=torch.ones(1))
    with pytest.raises(RuntimeError, match="no window_size argument"):
        call_varlen(old_fa4, q, q, q, window_size=(3, 0))


# ---- GPU: FA4's kernels against the oracle ----------------------------------------------------------------
def _fa4_runs_here() -> bool:
    if not torch.cuda.is_available() or not is_installed("flash_attn.cute"):
        return False
    return torch.cuda.get_device_capability()[0] in (9, 10)


needs_fa4 = pytest.mark.skipif(not _fa4_runs_here(), reason="needs an SM90/SM100 GPU and flash-attn-4")


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fresh", [True, False])
def test_gpu_fa4_against_the_oracle(page_size, seed, fresh):
    rng = random.Random(seed)
    bs = 1 + seed * 3
    prefix = [0 if fresh else rng.randint(0, 700) for _ in range(bs)]
    ext = [rng.randint(1, 300) for _ in range(bs)]
    sb = make_batch(prefix, ext, num_heads=16, num_kv_heads=4, head_dim=128, page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", seed=seed, score_scale=4.0)
    out = _run(sb, FA4Backend(sb.pool))
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("layer_kw", [{"sliding_window": 100}, {"logit_cap": 30.0}, {"head_dim": 64},
                                      {"v_head_dim": 64}])
def test_gpu_fa4_features_against_the_oracle(layer_kw):
    kw = {"head_dim": 128, **layer_kw}
    sb = make_batch([300, 0, 129], [64, 200, 1], num_heads=16, num_kv_heads=2, page_size=16,
                    dtype=torch.bfloat16, device="cuda", seed=7, score_scale=4.0, **kw)
    out = _run(sb, FA4Backend(sb.pool))
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2, layer_kw
    assert not math.isnan(_rel(out, ref))
