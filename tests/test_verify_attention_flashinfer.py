"""FlashInfer's verify graphs: on the CPU over the stand-in `flashinfer` module of test_flashinfer_cpu.py, on a
GPU (marked gpu) with the real package and a real CUDA graph.

Chains (q tokens a request, causal) are captured on a graph-mode paged prefill wrapper over the fixed
buffers; a replay with other lengths must attend like the oracle. Trees and the MLA wrapper are refused, so
the graph runner leaves them to eager verify.
"""

import pytest
import torch
from test_flashinfer_cpu import FakePrefill, fake_flashinfer  # noqa: F401 - the fixture is used by name

from attnserve._lazy import is_installed
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch


class FakeGraphPrefill(FakePrefill):
    """The stand-in prefill wrapper with FlashInfer's graph-mode buffer arguments."""

    def __init__(self, workspace, layout, use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, backend="auto"):
        super().__init__(workspace, layout, use_cuda_graph, paged_kv_indptr_buf, paged_kv_indices_buf,
                         paged_kv_last_page_len_buf, backend)
        self.qo_buf = qo_indptr_buf

    def plan(self, qo_indptr, *args, **kwargs):
        super().plan(qo_indptr, *args, **kwargs)
        if self.graph:  # the batch is fixed: the kernel reads the query offsets from the fixed buffer
            assert qo_indptr.numel() == self.qo_buf.numel(), "batch size differs from the wrapper's"
            self.qo_buf.copy_(qo_indptr)
            self.qo = self.qo_buf


def _padded_batch(sb, bs: int, q: int) -> ForwardBatch:
    """What the graph runner captures with: every request on the unused row 0 (all slot 0), q tokens each."""
    dev = sb.pool.device
    z = torch.zeros(bs * q, dtype=torch.int64, device=dev)
    return ForwardBatch(mode=ForwardMode.TARGET_VERIFY,
                        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),
                        seq_lens=torch.full((bs,), q, dtype=torch.int32, device=dev),
                        extend_lens=torch.full((bs,), q, dtype=torch.int32, device=dev), positions=z,
                        out_cache_loc=z, req_to_token=sb.fb.req_to_token, pool=sb.pool)


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("page_size", [1, 4])
def test_chain_verify_graph_replays_other_lengths(fake_flashinfer, page_size):  # noqa: F811
    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper = FakeGraphPrefill
    q = 4
    sb = make_batch([20, 3, 41], [q] * 3, page_size=page_size, mode=ForwardMode.TARGET_VERIFY, score_scale=20.0)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1, q_dtype=torch.float32)
    backend.init_graph_buffers(max_bs=4, max_tokens=4)
    meta = backend.plan(sb.fb)  # one eager step first: the layer signatures are known after it
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    meta = backend.plan_for_capture(_padded_batch(sb, 3, q))
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)  # what a capture records
    (key,) = [k for k in backend._graph_wrappers if k[0] == "verify"]
    assert key[1:3] == (3, q)
    wrapper = backend._graph_wrappers[key]
    assert wrapper.graph and wrapper.backend == "fa2"
    assert wrapper.qo_buf.data_ptr() == backend._graph_buffers.qo_indptr.data_ptr()

    meta = backend.plan_for_replay(sb.fb)
    out = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    assert backend._graph_wrappers[key] is wrapper and wrapper.plans == 2
    assert _rel(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-5
    # an eager step after a replay plans its own wrappers again
    meta = backend.plan(sb.fb)
    assert meta.graph_verify is None
    out = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    assert wrapper.plans == 2  # the graph's wrapper is not planned for an eager step
    assert _rel(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-5


def test_tree_verify_and_ragged_batches_are_not_captured(fake_flashinfer):  # noqa: F811
    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper = FakeGraphPrefill
    sb = make_batch([12, 5], [3, 3], custom_mask=True, mode=ForwardMode.TARGET_VERIFY)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1, q_dtype=torch.float32)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    with pytest.raises(ValueError, match="chain verify steps only"):
        backend.plan_for_capture(sb.fb)
    ragged = make_batch([12, 5], [3, 2], mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="as many tokens"):
        backend.plan_for_capture(ragged.fb)


def test_mla_wrapper_captures_decode_only(fake_flashinfer):  # noqa: F811
    sb = make_batch([12, 5], [1, 1], mla=(32, 16))
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)
    verify = make_batch([12, 5], [3, 3], mla=(32, 16), mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="captures decode only"):
        backend.plan_for_capture(verify.fb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not is_installed("flashinfer"),
                    reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_chain_verify_graph_replays_other_lengths(page_size):
    q = 5
    sb = make_batch([90, 3, 250, 41], [q] * 4, num_heads=16, num_kv_heads=4, head_dim=128, page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", mode=ForwardMode.TARGET_VERIFY, seed=5, score_scale=4.0)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=64)
    meta = backend.plan(sb.fb)  # eager warm-up: the layer signature becomes known
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    meta = backend.plan_for_capture(_padded_batch(sb, 4, q))
    q_static = sb.q.clone()  # [4 * q, 16, 128]
    backend.forward(q_static, None, None, sb.layer, sb.fb, meta)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.forward(q_static, None, None, sb.layer, sb.fb, meta)
    # the next step: the requests in another order with other lengths, over K/V already in the pool
    fb2 = ForwardBatch.from_lengths(ForwardMode.TARGET_VERIFY, [3, 1, 4, 2], [200, 50, 30, 2], [q] * 4,
                                    sb.fb.req_to_token, sb.pool)
    q_static.copy_(torch.randn_like(q_static) * 4)
    meta = backend.plan_for_replay(fb2)
    graph.replay()
    ref = reference_for_batch(q_static, sb.layer, fb2, compute_dtype=torch.float32)
    assert _rel(out_static.float(), ref.double()) < 1e-2
