"""FlashInfer's MLA backend: BatchMLAPagedAttentionWrapper over the latent pool.

The MLA pool's `[num_slots, 1, kv_lora_rank + rope]` buffer viewed as `[num_pages, page_size, width]`
and cut at kv_lora_rank gives FlashInfer's two caches (ckv and kpe) without a copy; the absorbed
query `[T, H, kv_lora_rank + rope]` is cut the same way. One wrapper serves decode and extend
alike (qo_indptr says how many new tokens each request has; causal masking is aligned to each
request's end, and the new latent rows are already in the pool).

The kernel is named like the MHA prefill's: fa3 on Hopper, fa2 elsewhere, or as requested, and
recorded in `kernel` / `kernel_reason`. FP8 latents: FlashInfer's MLA wrapper reads e4m3 on SM90
only, with bf16 queries and a per-tensor scale for each cache (the pool's one scale serves both);
e5m2, FP8 elsewhere and custom masks are refused here (selection's limits say so before a backend
is built).

CUDA graphs (decode): one wrapper per captured batch size over fixed index buffers, planned
again in place before each replay, as for MHA. MLAPlan's scratch depends on the SM count and the
latent width only, so the workspace holds it from the start (workspace.py); a capture checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnserve.attention.backends.flashinfer.common import MLA_FEATURES, default_q_dtype, flashinfer_module
from attnserve.attention.backends.flashinfer.csr import graph_step_metadata, host_csr
from attnserve.attention.backends.flashinfer.workspace import (
    MIB,
    Scratch,
    allocate_workspace,
    device_sm_count,
    graph_workspace,
    mla_scratch,
    with_margin,
)
from attnserve.attention.base import AttentionBackend
from attnserve.attention.metadata import MetadataBuffers, PagedKVMetadata, metadata_for_batch
from attnserve.batch import ForwardBatch


@dataclass(frozen=True)
class MLASignature:
    """What an MLA plan depends on that comes from the layer."""

    num_heads: int
    scale: float


def choose_mla_kernel(requested: str, device: torch.device) -> tuple[str, str]:
    """fa2 or fa3 for BatchMLAPagedAttentionWrapper, and why."""
    if requested not in ("auto", "fa2", "fa3"):
        raise ValueError(f"mla_kernel must be auto, fa2 or fa3, got {requested!r}")
    if requested != "auto":
        return requested, "requested explicitly"
    if device.type != "cuda":
        return "fa2", f"fa3 needs a Hopper GPU (this pool is on {device.type})"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return "fa2", f"FlashInfer's fa3 MLA kernel is built for SM90 (this is sm{major}x)"
    return "fa3", "Hopper (SM90): FlashInfer's fa3 MLA kernel applies"


@dataclass
class FlashInferMLAStep:
    """What plan() built for one step; FlashInfer's plans live in the wrappers the backend keeps."""

    meta: PagedKVMetadata
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (qo_indptr [B+1], kv_indptr [B+1], kv lengths [B])
    planned: set = field(default_factory=set)  # signatures planned so far this step
    graph_bs: int | None = None  # a decode graph's batch size: run its wrappers


class FlashInferMLABackend(AttentionBackend):
    """FlashInfer over an MLA latent pool: one absorbed MLA wrapper for decode and extend."""

    name = "flashinfer"
    features = MLA_FEATURES

    def __init__(self, pool, workspace_mb: int = 256, q_dtype: torch.dtype | None = None, mla_kernel: str = "auto",
                 num_sms: int | None = None, **options):
        """
        workspace_mb: the float workspace's smallest size; it is at least what MLAPlan takes (workspace.py).
        q_dtype: dtype of queries and outputs (default: the pool's, or bf16 for an FP8 pool).
        mla_kernel: BatchMLAPagedAttentionWrapper's kernel: "auto" (fa3 on Hopper), "fa2" or "fa3".
        num_sms: the SM count FlashInfer's plans size their scratch by (default: the GPU's; a pool off CUDA
            with none given sizes nothing).
        """
        super().__init__(pool, **options)
        if not pool.is_mla:
            raise ValueError("FlashInferMLABackend serves MLA latent pools; an MHA/GQA pool takes FlashInferMHABackend")
        q_dtype = q_dtype or default_q_dtype(pool)
        if pool.is_fp8:
            if pool.dtype != torch.float8_e4m3fn:
                raise ValueError(f"FlashInfer's MLA wrapper reads FP8 e4m3 latents only, the pool is {pool.dtype}; "
                                 "the triton backend reads both FP8 formats")
            if pool.device.type == "cuda" and torch.cuda.get_device_capability(pool.device)[0] != 9:
                raise ValueError("FlashInfer's MLA wrapper reads FP8 latents on SM90 (Hopper) only; "
                                 "the triton backend reads them on any GPU")
            q_dtype = torch.bfloat16
        self.kernel, self.kernel_reason = choose_mla_kernel(mla_kernel, pool.device)
        self._fi = flashinfer_module()
        self.num_sms = num_sms or device_sm_count(pool.device)
        # MLAPlan's scratch is known now (the batch does not enter it): eager steps and graphs alike fit
        scratch = 0 if self.num_sms is None else with_margin(self.graph_scratch().nbytes)
        self.workspace = allocate_workspace(max(workspace_mb * MIB, scratch), pool.device)
        self.q_dtype = q_dtype
        self._wrappers: dict[MLASignature, object] = {}
        self._graph_wrappers: dict[tuple[int, MLASignature], object] = {}
        self._signatures: list[MLASignature] = []
        self._graph: MetadataBuffers | None = None
        self._graph_kv_lens: torch.Tensor | None = None  # [max_bs] int32
        self.graph_max_tokens = 0

    # ---- per step ------------------------------------------------------------------------------
    def plan(self, fb: ForwardBatch) -> FlashInferMLAStep:
        if fb.custom_mask is not None:
            raise ValueError("FlashInfer's MLA wrapper has no custom masks (speculative verify with a tree)")
        return FlashInferMLAStep(metadata_for_batch(fb), self._host_arrays(fb))

    def _host_arrays(self, fb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qo_indptr, kv_indptr in pages, kv lengths) on the host, where FlashInfer's plan() reads them."""
        csr = host_csr(fb.seq_lens_cpu, fb.extend_lens_cpu, self.pool.page_size)
        return csr.qo_indptr, csr.kv_indptr, torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)  # [B+1], [B+1], [B]

    def _plan(self, wrapper, host, kv_indices: torch.Tensor, sig: MLASignature, causal: bool) -> None:
        qo_indptr, kv_indptr, kv_lens = host
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, sig.num_heads, self.pool.kv_lora_rank,
                     self.pool.qk_rope_head_dim, self.pool.page_size, causal, sig.scale, self.q_dtype,
                     self.pool.dtype)

    def _caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ckv `[num_pages, page_size, rank]`, kpe `[num_pages, page_size, rope]`): views of the latent buffer."""
        p = self.pool
        rows = p.get_key_buffer(layer_id).view(p.num_pages, p.page_size, p.head_dim)
        return rows[..., : p.kv_lora_rank], rows[..., p.kv_lora_rank :]

    def _attend(self, q: torch.Tensor, layer, fb, step: FlashInferMLAStep) -> torch.Tensor:
        """q `[T, H, rank + rope]` -> `[T, H, rank]`, decode or extend."""
        sig = MLASignature(layer.num_heads, float(layer.scaling))
        if sig not in self._signatures:
            self._signatures.append(sig)
        if step.graph_bs is not None:
            wrapper = self._graph_wrappers[(step.graph_bs, sig)]
        else:
            wrapper = self._wrappers.get(sig)
            if wrapper is None:
                wrapper = self._wrappers[sig] = self._fi.mla.BatchMLAPagedAttentionWrapper(
                    self.workspace, backend=self.kernel)
            if sig not in step.planned:
                self._plan(wrapper, step.host, step.meta.kv_indices, sig, causal=not fb.mode.is_decode)
                step.planned.add(sig)
        rank = self.pool.kv_lora_rank
        ckv, kpe = self._caches(layer.layer_id)
        q = q.to(self.q_dtype)
        scales = {}
        if self.pool.is_fp8:
            scale = self.pool.k_scale[layer.layer_id]
            scales = {"ckv_scale": scale, "kpe_scale": scale}
        return wrapper.run(q[..., :rank], q[..., rank:], ckv, kpe, **scales)  # [T, H, rank]

    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch, meta: FlashInferMLAStep) -> torch.Tensor:
        return self._attend(q, layer, fb, meta)

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch, meta: FlashInferMLAStep) -> torch.Tensor:
        return self._attend(q, layer, fb, meta)  # the new latent rows are read from the pool

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        """Index buffers now; the page-id buffer and the workspace are sized at the first capture."""
        self.graph_max_bs = max_bs
        self.graph_max_tokens = max_tokens
        self._graph = MetadataBuffers.allocate(max_bs, 0, self.pool.device)
        self._graph_kv_lens = torch.ones(max_bs, dtype=torch.int32, device=self.pool.device)  # [max_bs]

    def graph_scratch(self) -> Scratch:
        """The float scratch every MLA plan of this pool takes (batch and heads do not enter)."""
        return mla_scratch(self.pool.kv_lora_rank, self.num_sms)

    def _size_workspace_for_capture(self, fb: ForwardBatch) -> None:
        if self.num_sms is None:
            return
        scratch = self.graph_scratch()
        grown = graph_workspace(self.workspace, f"an MLA decode graph of {fb.batch_size} requests", scratch,
                                scratch.nbytes, bool(self._graph_wrappers), (self.graph_max_bs, self.graph_max_tokens))
        if grown is not None:
            self.workspace = grown
            self._wrappers.clear()  # eager wrappers hold the old buffer: built again over this one when next used

    def _plan_graph(self, fb: ForwardBatch, capture: bool) -> FlashInferMLAStep:
        """Capture or replay: page ids into the fixed buffer, then every signature's wrapper planned in place."""
        bs = fb.batch_size
        meta = graph_step_metadata(fb, self._graph, self.graph_max_bs, self.pool, bool(self._signatures),
                                   captured=bool(self._graph_wrappers))
        if capture:
            self._size_workspace_for_capture(fb)
        host = self._host_arrays(fb)
        for sig in self._signatures:
            key = (bs, sig)
            if key not in self._graph_wrappers:
                g = self._graph
                self._graph_wrappers[key] = self._fi.mla.BatchMLAPagedAttentionWrapper(
                    self.workspace, use_cuda_graph=True, qo_indptr=g.qo_indptr[: bs + 1],
                    kv_indptr=g.kv_indptr[: bs + 1], kv_indices=g.kv_indices, kv_len_arr=self._graph_kv_lens[:bs],
                    backend=self.kernel)
            self._plan(self._graph_wrappers[key], host, meta.kv_indices, sig, causal=False)
        return FlashInferMLAStep(meta, host, graph_bs=bs)

    def plan_for_capture(self, fb: ForwardBatch) -> FlashInferMLAStep:
        return self._plan_graph(fb, capture=True)

    def plan_for_replay(self, fb: ForwardBatch) -> FlashInferMLAStep:
        return self._plan_graph(fb, capture=False)
