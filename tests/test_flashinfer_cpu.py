"""The FlashInfer backend's plumbing on the CPU, over a stand-in `flashinfer` module.

The stand-in implements the wrapper calls the backend makes with FlashInfer's documented
semantics (NHD paged layout, CSR page tables, causal mask aligned to the end of the KV,
window_left, soft-cap, base-2 LSE, fixed buffers in graph mode) in plain PyTorch. So these
tests check what the backend hands FlashInfer (metadata, page views, window and mask
conversions, plan reuse per layer signature, graph buffers); the GPU tests check the real kernels.
"""

import math
import sys
import types

import pytest
import torch

import attnserve.attention.backends.flashinfer.csr as fi_csr
import attnserve.attention.backends.flashinfer.mha as fi_backend
from attnserve.attention.backends.flashinfer import (
    FlashInferMHABackend,
    FlashInferMLABackend,
    host_csr,
)
from attnserve.attention.hybrid import HybridAttentionBackend
from attnserve.attention.metadata import build_paged_metadata
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool, create_backend, get_spec
from attnserve.hardware import PRESET_HARDWARE
from attnserve.reference.attention import attend, reference_for_batch
from attnserve.reference.synthetic import make_batch

LOG2E = 1 / math.log(2)


def _attend_request(q, k, v, q_pos, kv_len, scale, window_left, cap, causal=True, custom=None):
    """q [M, Hq, D] against k/v [kv_len, Hkv, *] -> (o [M, Hq, Dv], lse base 2 [M, Hq])."""
    if kv_len == 0:  # an empty KV segment: whatever the kernel writes, the backend must not use it
        return torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype), \
            torch.full(q.shape[:2], float("nan"))
    k_pos = torch.arange(kv_len)
    if custom is not None:
        mask = custom.view(q.shape[0], kv_len)
    elif causal:
        mask = k_pos[None, :] <= q_pos[:, None]
    else:
        mask = torch.ones(q.shape[0], kv_len, dtype=torch.bool)
    if window_left >= 0:
        mask = mask & (k_pos[None, :] >= q_pos[:, None] - window_left)
    o = attend(q.double(), k.double(), v.double(), mask, scale, cap)
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,nhd->hmn", q.double(), k.double().repeat_interleave(group, 1)) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    lse = torch.logsumexp(s.masked_fill(~mask[None], -math.inf), -1).T * LOG2E  # [M, Hq]
    return o.to(q.dtype), lse.float()


class _Paged:
    def __init__(self, workspace, layout, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, backend="auto",
                 use_tensor_cores=False):
        assert layout == "NHD"
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.backend = backend
        self.plans = 0

    def _set_table(self, indptr, indices, last):
        # plan() reads indptr and last-page lengths on the host; handing it device tensors costs a sync
        assert indptr.device.type == "cpu" and last.device.type == "cpu", "indptr / last_page_len not on the host"
        assert int(indptr[-1]) == indices.numel() and last.numel() == indptr.numel() - 1
        if self.graph:  # graph mode: the batch size is fixed and the kernel reads the fixed buffers
            assert indptr.numel() == self.bufs[0].numel(), "batch size differs from the wrapper's"
            if indices.numel() > self.bufs[1].numel():
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self.bufs[0].copy_(indptr)
            self.bufs[1][: indices.numel()].copy_(indices)
            self.bufs[2].copy_(last)
            self.table = self.bufs
        else:
            self.table = (indptr.clone(), indices.clone(), last.clone())

    def _kv(self, kv, b, k_scale, v_scale):
        indptr, indices, last = self.table
        k_cache, v_cache = kv  # [num_pages, page_size, Hkv, D]
        pages = indices[indptr[b] : indptr[b + 1]].long()
        n = pages.numel()
        kv_len = 0 if n == 0 else (n - 1) * k_cache.shape[1] + int(last[b])
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].float() * (k_scale or 1.0)
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].float() * (v_scale or 1.0)
        return k, v, kv_len


class FakeDecode(_Paged):
    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, window_left=-1, logits_soft_cap=None,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        self._set_table(indptr, indices, last_page_len)
        self.window, self.cap, self.scale = window_left, logits_soft_cap, sm_scale
        self.plans += 1

    def run(self, q, kv, k_scale=None, v_scale=None):
        out = []
        for b in range(q.shape[0]):
            k, v, n = self._kv(kv, b, k_scale, v_scale)
            o, _ = _attend_request(q[b : b + 1].float(), k, v, torch.tensor([n - 1]), n, self.scale, self.window,
                                   self.cap)
            out.append(o)
        return torch.cat(out).to(q.dtype)


class FakePrefill(_Paged):
    def plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page_size, head_dim_vo=None,
             custom_mask=None, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             q_data_type=None, kv_data_type=None):
        assert custom_mask is None or self.backend == "fa2", "fa3 has no custom masks"
        if custom_mask is not None:  # the mask packer runs on the mask's device: that plan keeps device indptrs
            kv_indptr, last = kv_indptr.cpu(), last.cpu()
        else:
            assert qo_indptr.device.type == "cpu", "qo_indptr not on the host"
        self._set_table(kv_indptr, kv_indices, last)
        self.qo = qo_indptr.clone()
        self.mask, self.causal = custom_mask, causal
        self.window, self.cap, self.scale = window_left, logits_soft_cap, sm_scale
        self.plans += 1

    def run(self, q, kv, k_scale=None, v_scale=None, return_lse=False):
        outs, lses, m0 = [], [], 0
        for b in range(self.qo.numel() - 1):
            qb = q[self.qo[b] : self.qo[b + 1]].float()
            k, v, n = self._kv(kv, b, k_scale, v_scale)
            m = qb.shape[0]
            custom = None
            if self.mask is not None:
                custom, m0 = self.mask[m0 : m0 + m * n], m0 + m * n
            o, lse = _attend_request(qb, k, v, torch.arange(n - m, n), n, self.scale, self.window, self.cap,
                                     self.causal, custom)
            outs.append(o)
            lses.append(lse)
        o = torch.cat(outs).to(q.dtype)
        return (o, torch.cat(lses)) if return_lse else o


class FakeRagged:
    def __init__(self, workspace, layout, backend="auto"):
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, head_dim_vo=None, causal=False, sm_scale=None,
             logits_soft_cap=None, q_data_type=None, kv_data_type=None):
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu", "indptrs not on the host"
        self.qo, self.kv, self.causal, self.scale, self.cap = qo_indptr.clone(), kv_indptr.clone(), causal, sm_scale, \
            logits_soft_cap

    def run(self, q, k, v, return_lse=False):
        outs, lses = [], []
        for b in range(self.qo.numel() - 1):
            qb = q[self.qo[b] : self.qo[b + 1]].float()
            kb, vb = k[self.kv[b] : self.kv[b + 1]].float(), v[self.kv[b] : self.kv[b + 1]].float()
            n, m = kb.shape[0], qb.shape[0]
            o, lse = _attend_request(qb, kb, vb, torch.arange(n - m, n), n, self.scale, -1, self.cap, self.causal)
            outs.append(o)
            lses.append(lse)
        o = torch.cat(outs).to(q.dtype)
        return (o, torch.cat(lses)) if return_lse else o


class FakeMLA:
    """BatchMLAPagedAttentionWrapper: ckv/kpe caches [num_pages, page_size, *], causal aligned to each request's end."""

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.graph, self.backend, self.plans = use_cuda_graph, backend, 0
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_len_arr", kv_len_arr)):
            assert t.device.type == "cpu", f"{name} not on the host (plan() would sync to read it)"
        assert int(kv_indptr[-1]) <= kv_indices.numel() and kv_len_arr.numel() == qo_indptr.numel() - 1
        table = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if self.graph:  # the kernel reads the fixed buffers, whose sizes fix the batch
            assert qo_indptr.numel() == self.bufs[0].numel(), "batch size differs from the wrapper's"
            if kv_indices.numel() > self.bufs[2].numel():
                raise ValueError("kv_indices larger than the allocated buffer")
            for buf, t in zip(self.bufs, table):
                buf[: t.numel()].copy_(t)
            table = self.bufs
        else:
            table = tuple(t.clone() for t in table)
        self.table, self.causal, self.scale, self.heads = table, causal, sm_scale, num_heads
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale=None, kpe_scale=None):
        assert q_nope.shape[1] == self.heads
        assert (ckv_cache.dtype == torch.float8_e4m3fn) == (ckv_scale is not None), "FP8 caches need their scales"
        qo, kv_indptr, indices, kv_lens = (t.cpu() for t in self.table)
        out = torch.empty_like(q_nope)
        for b in range(qo.numel() - 1):
            pages = indices[kv_indptr[b] : kv_indptr[b + 1]].long()
            n = int(kv_lens[b])
            c = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:n].double() * (ckv_scale or 1.0)  # [n, rank]
            pe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n].double() * (kpe_scale or 1.0)  # [n, rope]
            rows = slice(int(qo[b]), int(qo[b + 1]))
            m = rows.stop - rows.start
            s = (torch.einsum("mhd,nd->hmn", q_nope[rows].double(), c)
                 + torch.einsum("mhd,nd->hmn", q_pe[rows].double(), pe)) * self.scale  # [H, m, n]
            if self.causal:
                visible = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
                s = s.masked_fill(~visible[None], -math.inf)
            out[rows] = torch.einsum("hmn,nd->mhd", torch.softmax(s, -1), c).to(out.dtype)
        return out


def fake_merge_state(v_a, s_a, v_b, s_b):
    m = torch.maximum(s_a, s_b)
    wa, wb = torch.exp2(s_a - m), torch.exp2(s_b - m)
    return (v_a * wa[..., None] + v_b * wb[..., None]) / (wa + wb)[..., None], m + torch.log2(wa + wb)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    mod.BatchPrefillWithRaggedKVCacheWrapper = FakeRagged
    mod.merge_state = fake_merge_state
    mod.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLA)
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


def _backend(pool, **kw):
    return backend_for_pool("flashinfer", pool, workspace_mb=1, **kw)


def _check(sb, backend, tol=1e-5):
    meta = backend.plan(sb.fb)
    out = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    return out


FEATURES = {"plain": {}, "window": {"sliding_window": 7}, "softcap": {"logit_cap": 3.0},
            "fp8": {"kv_dtype": "fp8_e4m3"}}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("decode", [True, False])
def test_paged_path_matches_oracle(fake_flashinfer, feature, page_size, decode):
    prefix, ext = ([9, 30, 1], [1, 1, 1]) if decode else ([9, 0, 21], [4, 11, 1])
    sb = make_batch(prefix, ext, page_size=page_size, score_scale=20.0 if feature != "softcap" else 1.0,
                    **FEATURES[feature])
    _check(sb, _backend(sb.pool, q_dtype=torch.float32), tol=2e-2 if feature == "fp8" else 1e-5)


@pytest.mark.parametrize("page_size", [1, 4])
def test_ragged_path_merges_prefix_and_new_tokens(fake_flashinfer, page_size):
    sb = make_batch([9, 0, 21], [4, 11, 1], page_size=page_size, score_scale=20.0, logit_cap=30.0)
    backend = _backend(sb.pool, prefill_path="ragged")
    _check(sb, backend)
    assert backend.prefill_kernel == "fa2" and "cpu" in backend.prefill_kernel_reason


def test_verify_custom_mask_runs_on_fa2(fake_flashinfer):
    sb = make_batch([12, 5], [4, 3], custom_mask=True, mode=ForwardMode.TARGET_VERIFY, score_scale=20.0)
    _check(sb, _backend(sb.pool, prefill_kernel="fa3"))  # the stand-in asserts fa2 was used for the mask


def test_one_plan_per_layer_signature_per_step(fake_flashinfer):
    sb = make_batch([9, 30], [1, 1])
    backend = _backend(sb.pool)
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)  # a second layer of the same shape
    (wrapper,) = backend._decode_wrappers.values()
    assert wrapper.plans == 1
    _check(sb, backend)  # next step plans again
    assert wrapper.plans == 2


def test_decode_graph_buffers_follow_replays(fake_flashinfer):
    sb = make_batch([20, 3, 41, 9], [1] * 4, page_size=4, score_scale=20.0)
    backend = _backend(sb.pool)
    with pytest.raises(ValueError, match="init_graph_buffers"):
        backend.plan_for_capture(sb.fb)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    with pytest.raises(ValueError, match="eager step"):
        backend.plan_for_capture(sb.fb)
    _check(sb, backend)
    meta = backend.plan_for_capture(sb.fb)
    fb2 = ForwardBatch.from_lengths(ForwardMode.DECODE, [3, 1, 4, 2], [30, 12, 5, 2], [1] * 4,
                                    sb.fb.req_to_token, sb.pool)
    meta = backend.plan_for_replay(fb2)
    out = backend.forward(sb.q, None, None, sb.layer, fb2, meta)
    ref = reference_for_batch(sb.q, sb.layer, fb2)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert list(backend._graph_wrappers) == [(4, next(iter(backend._decode_wrappers)))]
    with pytest.raises(ValueError, match="decode only"):
        backend.plan_for_replay(make_batch([3], [2]).fb)


def test_bad_options(fake_flashinfer):
    sb = make_batch([3], [1])
    with pytest.raises(ValueError, match="prefill_kernel"):
        _backend(sb.pool, prefill_kernel="fa9")
    with pytest.raises(ValueError, match="prefill_path"):
        _backend(sb.pool, prefill_path="dense")
    with pytest.raises(ValueError, match="e4m3 latents only"):
        _backend(make_batch([3], [1], mla=(32, 16), kv_dtype="fp8_e5m2").pool)
    with pytest.raises(ValueError, match="mla_kernel"):
        _backend(make_batch([3], [1], mla=(32, 16)).pool, mla_kernel="fa9")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_host_csr_matches_device_metadata(page_size):
    """The host arrays handed to plan() equal what the device builder computes, empty prefixes included."""
    seq, ext = [1, 17, 16, 33, 4, 64], [1, 5, 16, 2, 4, 1]
    for lens in (seq, [s - e for s, e in zip(seq, ext)]):  # whole sequences, then prefixes (some empty)
        width = max(seq)
        req_to_token = torch.arange(len(seq) * width, dtype=torch.int32).view(len(seq), width)
        meta = build_paged_metadata(req_to_token, torch.arange(len(seq)), torch.tensor(lens), torch.tensor(ext),
                                    page_size)
        host = host_csr(lens, ext, page_size)
        assert torch.equal(host.qo_indptr, meta.qo_indptr)
        assert torch.equal(host.kv_indptr, meta.kv_indptr)
        assert torch.equal(host.kv_last_page_len, meta.kv_last_page_len)


def _shared_prefix_decode(sb, rows, new_lens):
    """Decode requests that reuse request rows, as requests sharing a cached prefix do (same pages)."""
    return ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [n - 1 for n in new_lens], [1] * len(rows),
                                     sb.fb.req_to_token, sb.pool)


def test_graph_page_buffer_holds_batches_listing_more_pages_than_the_pool(fake_flashinfer):
    """Six requests over two page tables list more pages than the pool has; capture and replay still fit."""
    sb = make_batch([40, 37], [1, 1], page_size=4, extra_pages=0, score_scale=20.0)
    num_pages = sb.pool.num_pages
    backend = _backend(sb.pool)
    _check(sb, backend)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    fb6 = _shared_prefix_decode(sb, [1, 2, 1, 2, 1, 2], [41, 38, 30, 38, 41, 9])
    listed = sum(-(-s // 4) for s in fb6.seq_lens_cpu)
    assert listed > num_pages
    meta = backend.plan_for_capture(fb6)
    width_pages = -(-sb.fb.req_to_token.shape[1] // 4)
    assert backend._graph_buffers.kv_indices.numel() == 8 * width_pages
    fb6 = _shared_prefix_decode(sb, [2, 1, 2, 1, 2, 1], [38, 41, 38, 41, 20, 41])
    meta = backend.plan_for_replay(fb6)
    q = torch.randn(6, *sb.q.shape[1:], generator=torch.Generator().manual_seed(1)) * 20
    out = backend.forward(q, None, None, sb.layer, fb6, meta)
    ref = reference_for_batch(q, sb.layer, fb6)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    (wrapper,) = backend._graph_wrappers.values()
    assert wrapper.bufs[1] is backend._graph_buffers.kv_indices  # the captured address still in use


def test_graph_page_buffer_is_fixed_after_capture(fake_flashinfer):
    """A wider page table after capture cannot move the buffer the graphs read: refuse it."""
    sb = make_batch([9, 30], [1, 1], page_size=4)
    backend = _backend(sb.pool)
    _check(sb, backend)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)
    backend.plan_for_capture(sb.fb)
    wider = torch.zeros(sb.fb.req_to_token.shape[0], sb.fb.req_to_token.shape[1] + 64, dtype=torch.int32)
    wider[:, : sb.fb.req_to_token.shape[1]] = sb.fb.req_to_token
    fb = ForwardBatch.from_lengths(ForwardMode.DECODE, [1, 2], [8, 29], [1, 1], wider, sb.pool)
    with pytest.raises(ValueError, match="req_to_token width"):
        backend.plan_for_replay(fb)


def test_replay_plans_only_the_graph_metadata(fake_flashinfer, monkeypatch):
    """plan_for_replay builds page ids once, into the fixed buffer, and no eager metadata besides."""

    sb = make_batch([20, 3], [1, 1], page_size=4)
    backend = _backend(sb.pool)
    _check(sb, backend)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)
    meta = backend.plan_for_capture(sb.fb)
    calls = {"eager": 0, "graph": 0}
    real_build = fi_backend.build_paged_metadata

    def counting_build(*args, **kwargs):
        calls["graph" if kwargs.get("buffers") is not None else "eager"] += 1
        return real_build(*args, **kwargs)

    monkeypatch.setattr(fi_backend, "build_paged_metadata", counting_build)
    monkeypatch.setattr(fi_csr, "build_paged_metadata", counting_build)
    monkeypatch.setattr(fi_backend, "metadata_for_batch", lambda *a, **k: calls.__setitem__("eager", 99))
    meta = backend.plan_for_replay(sb.fb)
    assert calls == {"eager": 0, "graph": 1}
    out = backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


# ---- one name, one class per pool kind ----------------------------------------------------------------
def test_the_flashinfer_name_resolves_to_the_class_that_fits_the_pool(fake_flashinfer):
    mha = make_batch([3], [1]).pool
    mla = make_batch([3], [1], mla=(32, 16)).pool
    spec = get_spec("flashinfer")
    assert spec.load_class(mha) is FlashInferMHABackend and spec.load_class(mla) is FlashInferMLABackend
    h100 = PRESET_HARDWARE["h100"]  # every package counts as installed; the pools stay on the CPU
    assert type(create_backend("flashinfer", mha, hw=h100, workspace_mb=1)) is FlashInferMHABackend
    assert type(create_backend("flashinfer", mla, hw=h100, workspace_mb=1)) is FlashInferMLABackend
    assert type(_backend(mla)) is FlashInferMLABackend and type(_backend(mha)) is FlashInferMHABackend
    with pytest.raises(ValueError, match="MLA pool takes FlashInferMLABackend"):
        FlashInferMHABackend(mla, workspace_mb=1)
    with pytest.raises(ValueError, match="MHA/GQA pool takes FlashInferMHABackend"):
        FlashInferMLABackend(mha, workspace_mb=1)


def test_each_class_declares_what_it_serves_and_the_name_both():
    assert FlashInferMHABackend.features.attention_types == {"MHA", "GQA"}
    assert FlashInferMLABackend.features.attention_types == {"MLA"}
    assert not FlashInferMLABackend.features.custom_mask and "fp8_e5m2" not in FlashInferMLABackend.features.kv_dtypes
    assert get_spec("flashinfer").features.attention_types == {"MHA", "GQA", "MLA"}
    assert not get_spec("flashinfer").features.expanded_mla_prefill


# ---- MLA (BatchMLAPagedAttentionWrapper) ----------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("decode", [True, False])
def test_mla_matches_oracle(fake_flashinfer, page_size, decode):
    prefix, ext = ([9, 30, 1], [1, 1, 1]) if decode else ([9, 0, 21], [4, 11, 1])
    sb = make_batch(prefix, ext, num_heads=6, mla=(32, 16), page_size=page_size, score_scale=8.0)
    backend = _backend(sb.pool)
    _check(sb, backend)
    assert isinstance(backend, FlashInferMLABackend)
    assert backend.kernel == "fa2" and "cpu" in backend.kernel_reason
    (wrapper,) = backend._wrappers.values()
    assert wrapper.backend == "fa2" and wrapper.causal == (not decode)


def test_mla_fp8_latent_with_its_scale(fake_flashinfer):
    sb = make_batch([9, 30, 1], [1, 1, 1], num_heads=6, mla=(32, 16), page_size=4, kv_dtype="fp8_e4m3",
                    dtype=torch.bfloat16, score_scale=8.0)
    assert sb.pool.k_scale[0] != 1.0
    backend = _backend(sb.pool)
    assert backend.q_dtype == torch.bfloat16  # FlashInfer's FP8 MLA takes bf16 queries
    _check(sb, backend, tol=1e-2)


def test_mla_kernel_named_like_the_mha_wrapper(fake_flashinfer):
    sb = make_batch([9, 30], [1, 1], num_heads=4, mla=(32, 16))
    backend = _backend(sb.pool, mla_kernel="fa3")
    _check(sb, backend)
    assert next(iter(backend._wrappers.values())).backend == "fa3"
    assert backend.kernel_reason == "requested explicitly"


def test_mla_refuses_a_custom_mask(fake_flashinfer):
    sb = make_batch([12, 5], [4, 3], num_heads=4, mla=(32, 16), custom_mask=True, mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="no custom masks"):
        _backend(sb.pool).plan(sb.fb)


def test_mla_decode_graph_buffers_follow_replays(fake_flashinfer):
    sb = make_batch([20, 3, 41, 9], [1] * 4, num_heads=4, mla=(32, 16), page_size=4, score_scale=8.0)
    backend = _backend(sb.pool)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    with pytest.raises(ValueError, match="eager step"):
        backend.plan_for_capture(sb.fb)
    _check(sb, backend)
    meta = backend.plan_for_capture(sb.fb)
    (captured,) = backend._graph_wrappers.values()
    for lens in ([31, 13, 6, 3], [2, 21, 42, 10]):
        fb = ForwardBatch.from_lengths(ForwardMode.DECODE, [1, 2, 3, 4], [n - 1 for n in lens], [1] * 4,
                                       sb.fb.req_to_token, sb.pool)
        meta = backend.plan_for_replay(fb)
        out = backend.forward(sb.q, None, None, sb.layer, fb, meta)
        ref = reference_for_batch(sb.q, sb.layer, fb)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert list(backend._graph_wrappers.values()) == [captured]  # one wrapper for batch size 4, planned again
    assert captured.table[2] is backend._graph.kv_indices and captured.plans == 3
    with pytest.raises(ValueError, match="decode only"):
        backend.plan_for_replay(make_batch([3], [2], num_heads=4, mla=(32, 16)).fb)


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton runs CPU pools under the interpreter only; "
                    "with CUDA, test_flashinfer_backend.py runs the real pair")
def test_mla_hybrid_flashinfer_prefill_triton_decode(fake_flashinfer):
    """What selection picks for DeepSeek on an H200 (prefill flashinfer, decode triton) on one latent pool."""

    sb = make_batch([9, 0, 21], [4, 11, 1], num_heads=4, mla=(32, 16), page_size=4, score_scale=8.0,
                    dtype=torch.bfloat16)
    hybrid = HybridAttentionBackend(_backend(sb.pool), backend_for_pool("triton", sb.pool))
    _check(sb, hybrid, tol=1e-2)  # extend: FlashInfer's MLA wrapper
    fb = ForwardBatch.from_lengths(ForwardMode.DECODE, [1, 2, 3], [12, 10, 21], [1, 1, 1], sb.fb.req_to_token,
                                   sb.pool)
    q = sb.q[:3].clone()
    meta = hybrid.plan(fb)
    out = hybrid.forward(q, None, None, sb.layer, fb, meta)  # decode: triton's MLA kernel over the same rows
    ref = reference_for_batch(q, sb.layer, fb)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert hybrid.backend_for(fb.mode).name == "triton"
