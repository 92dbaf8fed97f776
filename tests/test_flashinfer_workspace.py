"""FlashInfer's float workspace holds every plan a CUDA graph captures; a capture that cannot fit is refused.

The stand-in wrappers lay out in the workspace the split-KV scratch FlashInfer's plan() lays out there, by a
transcription of its scheduler (include/flashinfer/attention/scheduler.cuh: PrefillSplitQOKVIndptr and
PrefillPlan, DecodePlan with PartitionPagedKVCacheBinarySearchMinNumPagePerBatch, MLAPlan) that walks the
actual page tables, and fail as FlashInfer does ("Buffer overflow when allocating memory for ...") when it
does not fit. So the backend's sizing (attention/backends/flashinfer/workspace.py, closed forms) is checked
against the scheduler's own loop, for the shapes a GPU captures, on the CPU.
"""

import math

import pytest
import torch
from engine_helpers import VOCAB, tiny_model
from test_flashinfer_cpu import FakeDecode, FakeMLA, fake_flashinfer  # noqa: F401 - the fixture is used by name
from test_verify_attention_flashinfer import FakeGraphPrefill

from attnserve.attention.backends.flashinfer.workspace import (
    decode_graph_scratch,
    mla_scratch,
    prefill_graph_scratch,
)
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.engine.cuda_graph import CudaGraphRunner, verify_batch_sizes
from attnserve.engine.startup import verify_graph_shape
from attnserve.kvcache.pool import ReqToTokenPool, make_pool
from attnserve.reference.synthetic import make_batch

SMS = 132  # an H100 / H200
DECODE_BLOCKS_PER_SM = 16  # the CUDA-core decode kernel's occupancy at its highest


# ---- FlashInfer's scheduler, transcribed -------------------------------------------------------------------
def _cta_tile_q(packed_qo_len, head_dim):  # FA2DetermineCtaTileQ, SM80+
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def prefill_plan_allocations(qo_indptr, kv_indptr, hq, hkv, head_dim_vo, page_size, cuda_graph):
    """PrefillPlan's float-workspace allocations [(name, bytes)], from the page tables it is handed."""
    batch, total_rows = len(qo_indptr) - 1, qo_indptr[-1]
    group = hq // hkv
    max_batch_size_if_split = 2 * SMS // hkv
    packed = [(qo_indptr[i + 1] - qo_indptr[i]) * group for i in range(batch)]
    kv_len = [kv_indptr[i + 1] - kv_indptr[i] for i in range(batch)]
    if cuda_graph:
        cta = _cta_tile_q((total_rows - batch + 1) * group, head_dim_vo)
        total_num_tiles_q = math.ceil(total_rows * group / cta) + batch - 1
    else:
        cta = _cta_tile_q(sum(packed) // batch, head_dim_vo)
        total_num_tiles_q = sum(math.ceil(p / cta) for p in packed)
    # PrefillBinarySearchKVChunkSize
    max_kv_len = max([1, *kv_len])
    low, high = max(128 // page_size, 1), max_kv_len
    while low < high:
        mid = (low + high) // 2
        if sum(math.ceil(p / cta) * math.ceil(max(k, 1) / mid) for p, k in zip(packed, kv_len)) > \
                max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    split_kv = cuda_graph or low < max_kv_len
    new_batch_size = sum(math.ceil(p / cta) * math.ceil(max(k, 1) / low) for p, k in zip(packed, kv_len))
    padded = max(max_batch_size_if_split, total_num_tiles_q) if cuda_graph else new_batch_size
    assert new_batch_size <= padded, "new batch size should not exceed padded batch size"
    if not split_kv:
        return []
    return [("batch_prefill_tmp_v", hq * padded * cta * head_dim_vo * 4), ("batch_prefill_tmp_s", hq * padded * cta * 4)]


def decode_plan_allocations(kv_indptr, hq, hkv, head_dim, page_size, cuda_graph):
    """DecodePlan's float-workspace allocations on CUDA cores."""
    batch = len(kv_indptr) - 1
    max_grid_size, gdy = DECODE_BLOCKS_PER_SM * SMS, hkv
    if batch * gdy >= max_grid_size:
        split_kv, new_batch_size = False, batch
    else:
        pages = [kv_indptr[i + 1] - kv_indptr[i] for i in range(batch)]
        low, high = max(128 // page_size, 1), max(pages)
        while low < high:
            mid = (low + high) // 2
            if sum(math.ceil(p / mid) for p in pages) * gdy > max_grid_size:
                low = mid + 1
            else:
                high = mid
        new_batch_size = sum(math.ceil(max(p, 1) / low) for p in pages)
        split_kv = not (new_batch_size == batch and not cuda_graph)
    padded = (max_grid_size // gdy if split_kv else batch) if cuda_graph else new_batch_size
    if not split_kv:
        return []
    return [("batch_decode_tmp_v", hq * padded * head_dim * 4), ("batch_decode_tmp_s", hq * padded * 4)]


def mla_plan_allocations(qo_indptr, num_heads, head_dim_o):
    batch = len(qo_indptr) - 1
    cluster = 2 if (qo_indptr[-1] * num_heads) // batch > 64 else 1
    rows = (SMS // cluster) * cluster * 64
    return [("mla_partial_o", 2 * rows * 2 * head_dim_o), ("mla_partial_lse", 2 * rows * 4)]


def lay_out(workspace: torch.Tensor, allocations) -> None:
    """AlignedAllocator over the float workspace: each buffer 16-byte aligned after the one before."""
    have, offset = workspace.numel(), 0
    for name, size in allocations:
        start = -(-offset // 16) * 16
        if start + size > have:
            raise RuntimeError(f"Buffer overflow when allocating memory for {name} with size {size} and alignment 16, "
                               f"but only {have - start} bytes available in AlignedAllocator")
        offset = start + size


class SizedPrefill(FakeGraphPrefill):
    def __init__(self, workspace, layout, **kw):
        super().__init__(workspace, layout, **kw)
        self.workspace = workspace

    def plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page_size, head_dim_vo=None, **kw):
        super().plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page_size, head_dim_vo=head_dim_vo, **kw)
        lay_out(self.workspace, prefill_plan_allocations(qo_indptr.tolist(), kv_indptr.tolist(), hq, hkv,
                                                         head_dim_vo or d, page_size, self.graph))


class SizedDecode(FakeDecode):
    def __init__(self, workspace, layout, use_tensor_cores=False, **kw):
        super().__init__(workspace, layout, use_tensor_cores=use_tensor_cores, **kw)
        self.workspace, self.tensor_cores = workspace, use_tensor_cores

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, **kw):
        super().plan(indptr, indices, last_page_len, hq, hkv, d, page_size, **kw)
        kv = indptr.tolist()
        if self.tensor_cores:  # the prefill plan, one query row a request
            allocations = prefill_plan_allocations(list(range(len(kv))), kv, hq, hkv, d, page_size, self.graph)
        else:
            allocations = decode_plan_allocations(kv, hq, hkv, d, page_size, self.graph)
        lay_out(self.workspace, allocations)


class SizedMLA(FakeMLA):
    def __init__(self, workspace, **kw):
        super().__init__(workspace, **kw)
        self.workspace = workspace

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, *args):
        super().plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, *args)
        lay_out(self.workspace, mla_plan_allocations(qo_indptr.tolist(), num_heads, head_dim_ckv))


def _padded_batch(sb, bs: int, q: int) -> ForwardBatch:
    """What the graph runner captures with: bs requests of q tokens on the padding row (q = 1: decode)."""
    z = torch.zeros(bs * q, dtype=torch.int64)
    return ForwardBatch(mode=ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY,
                        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
                        seq_lens=torch.full((bs,), q, dtype=torch.int32),
                        extend_lens=torch.full((bs,), q, dtype=torch.int32), positions=z, out_cache_loc=z,
                        req_to_token=sb.fb.req_to_token, pool=sb.pool)


@pytest.fixture
def sized_flashinfer(fake_flashinfer):  # noqa: F811
    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper = SizedPrefill
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper = SizedDecode
    fake_flashinfer.mla.BatchMLAPagedAttentionWrapper = SizedMLA
    return fake_flashinfer


# ---- the closed forms against the transcription --------------------------------------------------------------
def test_the_h200_verify_capture_that_overflowed_64_mib():
    """16 query / 4 KV heads of 128, 4 requests x 5 tokens on 132 SMs: FlashInfer asked for 69206016 bytes."""
    scratch = prefill_graph_scratch(4, 20, 16, 4, 128, SMS)
    assert scratch.tmp_bytes == 69206016 > 64 << 20
    assert dict(prefill_plan_allocations([0, 5, 10, 15, 20], [0, 23, 25, 88, 100], 16, 4, 128, 4, True)) == {
        "batch_prefill_tmp_v": scratch.tmp_bytes, "batch_prefill_tmp_s": scratch.lse_bytes}


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (32, 8, 128), (8, 8, 64), (64, 8, 128), (8, 1, 256)])
@pytest.mark.parametrize("bs,q", [(1, 1), (1, 9), (4, 5), (8, 1), (64, 4), (128, 8), (256, 4)])
def test_closed_forms_match_the_scheduler(hq, hkv, d, bs, q):
    qo = [i * q for i in range(bs + 1)]
    kv = [0]
    for i in range(bs):  # ragged page counts: the graph-mode sizes must not depend on them
        kv.append(kv[-1] + 1 + (i * 37) % 300)
    want = dict(prefill_plan_allocations(qo, kv, hq, hkv, d, 1, True))
    got = prefill_graph_scratch(bs, bs * q, hq, hkv, d, SMS)
    assert (got.tmp_bytes, got.lse_bytes) == (want["batch_prefill_tmp_v"], want["batch_prefill_tmp_s"])
    decode = dict(decode_plan_allocations(kv, hq, hkv, d, 1, True))
    if decode:  # split-KV on: the bound is the scheduler's size at the highest occupancy
        assert decode_graph_scratch(hq, hkv, d, SMS).tmp_bytes == decode["batch_decode_tmp_v"]
    mla = dict(mla_plan_allocations(qo, hq, 512))
    assert mla_scratch(512, SMS).tmp_bytes >= mla["mla_partial_o"]


# ---- the backend sizes its workspace at the first capture ----------------------------------------------------
def test_verify_capture_grows_a_workspace_too_small_for_it(sized_flashinfer):
    """The H200 failure on the CPU: a 64 MiB workspace, a verify graph of 4 x 5 tokens; the capture grows it."""
    q = 5
    sb = make_batch([90, 3, 250, 41], [q] * 4, num_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                    mode=ForwardMode.TARGET_VERIFY, seed=5)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=64, num_sms=SMS)
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    with pytest.raises(RuntimeError, match="Buffer overflow .* batch_prefill_tmp_v with size 69206016"):
        lay_out(backend.workspace, prefill_plan_allocations([0, 5, 10, 15, 20], [0] * 5, 16, 4, 128, 16, True))
    meta = backend.plan_for_capture(_padded_batch(sb, 4, q))  # the stand-in raises if the plan does not fit
    assert backend.workspace.numel() >= prefill_graph_scratch(4, 20, 16, 4, 128, SMS).nbytes
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    (wrapper,) = backend._graph_wrappers.values()
    assert wrapper.workspace is backend.workspace
    meta = backend.plan(sb.fb)  # eager wrappers are built again over the grown workspace
    backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    assert all(w.workspace is backend.workspace for w in backend._prefill_wrappers.values())


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_declared_graphs_all_fit_the_workspace_sized_at_the_first_capture(sized_flashinfer, tensor_cores):
    """Decode at every size up to max_bs, then verify chains up to max_tokens: one workspace, never moved."""
    q, sizes = 5, [1, 2, 4, 8]
    sb = make_batch([90, 3, 250, 41, 7, 19, 64, 120], [1] * 8, num_heads=16, num_kv_heads=4, head_dim=128,
                    page_size=16, seed=3)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=4, num_sms=SMS, use_tensor_cores=tensor_cores)
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    backend.init_graph_buffers(max_bs=8, max_tokens=8 * q)
    meta = backend.plan_for_capture(sb.fb)
    workspace = backend.workspace
    assert workspace.numel() >= backend.graph_workspace_bytes(8, 8 * q)
    for bs in reversed(sizes):
        meta = backend.plan_for_capture(_padded_batch(sb, bs, 1))
        meta = backend.plan_for_capture(_padded_batch(sb, bs, q))
    assert backend.workspace is workspace


def test_a_capture_beyond_the_declared_graphs_is_refused_with_the_sizes(sized_flashinfer):
    sb = make_batch([40, 37], [1, 1], num_heads=16, num_kv_heads=4, head_dim=128, page_size=16)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1, num_sms=SMS)
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)  # decode only
    meta = backend.plan_for_capture(sb.fb)
    have = backend.workspace.numel()
    need = prefill_graph_scratch(2, 80, 16, 4, 128, SMS)
    assert need.nbytes > have
    with pytest.raises(ValueError) as err:
        backend.plan_for_capture(_padded_batch(sb, 2, 40))  # verify 2 x 40 tokens
    msg = str(err.value)
    assert f"needs {need.nbytes} bytes" in msg and f"batch_prefill_tmp_v {need.tmp_bytes}" in msg
    assert f"than the {have} bytes" in msg and "init_graph_buffers(max_bs=2, max_tokens=2)" in msg
    assert [k for k in backend._graph_wrappers if k[0] == "verify"] == []


def test_mla_workspace_holds_its_plan_from_the_start(sized_flashinfer):
    """MLAPlan's scratch depends on the SM count and the latent width only: sized when the backend is built."""
    sb = make_batch([20, 3, 41, 9], [1] * 4, num_heads=16, mla=(512, 64), page_size=4)
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1, num_sms=SMS)
    assert backend.workspace.numel() >= mla_scratch(512, SMS).nbytes > 1 << 20  # 2 x 132 x 64 rows of 512 latents
    workspace = backend.workspace
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)  # the stand-in raises if a plan does not fit
    backend.init_graph_buffers(max_bs=8, max_tokens=8)
    meta = backend.plan_for_capture(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    assert next(iter(backend._graph_wrappers.values())).workspace is workspace is backend.workspace


def test_off_cuda_without_an_sm_count_the_workspace_stays_as_given(sized_flashinfer):
    sb = make_batch([20, 3], [1, 1])
    backend = backend_for_pool("flashinfer", sb.pool, workspace_mb=1)
    assert backend.num_sms is None
    meta = backend.plan(sb.fb)
    backend.forward(sb.q, None, None, sb.layer, sb.fb, meta)
    backend.init_graph_buffers(max_bs=2, max_tokens=2)
    with pytest.raises(RuntimeError, match="Buffer overflow"):  # the stand-in counts 132 SMs; the backend none
        backend.plan_for_capture(sb.fb)


# ---- the engine tells the backend about its verify graphs before it captures decode --------------------------
class CpuRecordingRunner(CudaGraphRunner):
    def _record(self, run):
        return None, run()


def _engine_graphs(max_tokens: int):
    model = tiny_model({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 256,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }).model
    pool = make_pool(model.kv_cache_spec(), 8, 16, dtype=torch.float32, device="cpu")
    req_pool = ReqToTokenPool(4, 64, device="cpu")
    padding_row = req_pool.alloc()
    backend = backend_for_pool("flashinfer", pool, workspace_mb=1, num_sms=SMS)
    runner = CpuRecordingRunner(model, backend, pool, req_pool, padding_row, [1, 2, 4, 8], torch.device("cpu"),
                                max_tokens=max_tokens)
    return backend, runner


def test_engine_sizes_the_workspace_for_its_verify_graphs(sized_flashinfer):
    from types import SimpleNamespace

    q, sizes = verify_graph_shape(SimpleNamespace(speculative_num_draft_tokens=8), [1, 2, 4, 8])
    assert (q, sizes) == (9, verify_batch_sizes([1, 2, 4, 8], 9))
    backend, runner = _engine_graphs(max_tokens=q * sizes[-1])
    runner.capture()
    assert (backend.graph_max_bs, backend.graph_max_tokens) == (8, q * 8)
    workspace = backend.workspace
    runner.capture_verify(q, False, sizes)  # every plan fits (the stand-ins raise otherwise)
    assert backend.workspace is workspace and sum(k[1] == q for k in runner.graphs) == len(sizes)

    backend, runner = _engine_graphs(max_tokens=0)  # decode graphs only: a verify graph later cannot fit
    runner.capture()
    with pytest.raises(ValueError, match="bytes of FlashInfer workspace"):
        runner.capture_verify(q, False, sizes)
