"""FlashInfer's paged MHA/GQA wrappers behind the attnserve contract.

The pool's `[num_slots, kv_heads, d]` buffers are FlashInfer's NHD paged layout
`[num_pages, page_size, kv_heads, d]` viewed without a copy, so the CSR metadata
of metadata.py is handed over as it is.

- Decode: BatchDecodeWithPagedKVCacheWrapper, tensor-core path by default.
- Prefill: "paged" (default) runs the paged prefill wrapper over the whole KV with
  causal masking aligned to each request's end (new K/V are already in the pool);
  "ragged" runs the new tokens through the ragged wrapper and the cached prefix
  through the paged one, merged by log-sum-exp. The fa2/fa3 kernel is chosen
  explicitly (fa3 on Hopper when no custom mask and no FP8 KV) and recorded in
  `prefill_kernel` / `prefill_kernel_reason`.
- Wrappers are planned once per step per layer signature (heads, widths, window,
  soft-cap, scale): lazily at a signature's first layer in eager mode, and for
  every signature seen so far in plan_for_capture / plan_for_replay. plan() reads
  indptr and last-page lengths on the host, so they are built there from the
  batch's host lengths (a device copy would cost a sync per step); page ids stay
  on the device.
- CUDA graphs (decode): one wrapper per captured batch size over fixed-address
  metadata buffers, as FlashInfer fixes the batch size of a graph-mode wrapper.
  The page-id buffer holds max_bs full rows of req_to_token: a batch can list more
  pages than the pool has (a shared prefix counts once per request using it).
  Speculative verify chains (q tokens a request, causal) are captured the same way
  on the paged prefill wrapper, one per (batch size, q); trees verify eagerly.
- Workspace (workspace.py): at the first capture the float workspace grows to hold the
  split-KV scratch of every graph init_graph_buffers(max_bs, max_tokens) announced (decode
  up to max_bs requests, verify chains up to max_tokens tokens) for every layer signature;
  a later capture that needs more is refused with the sizes, as graphs keep its address.

MLA latent pools have their own backend (mla.py); the registry picks by pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnserve.attention.backends.flashinfer.common import FEATURES, default_q_dtype, flashinfer_module
from attnserve.attention.backends.flashinfer.csr import HostCSR, graph_step_metadata, host_csr
from attnserve.attention.backends.flashinfer.workspace import (
    MIB,
    Scratch,
    allocate_workspace,
    decode_graph_scratch,
    device_sm_count,
    graph_workspace,
    prefill_graph_scratch,
)
from attnserve.attention.base import AttentionBackend
from attnserve.attention.metadata import (
    MetadataBuffers,
    PagedKVMetadata,
    build_paged_metadata,
    metadata_for_batch,
)
from attnserve.batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class _Signature:
    """Everything a FlashInfer plan depends on that comes from the layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window_left: int  # -1: full attention
    logit_cap: float | None
    scale: float

    @classmethod
    def of(cls, layer) -> _Signature:
        window = -1 if layer.sliding_window is None else layer.sliding_window - 1  # ours counts the query
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, window,
                   layer.logit_cap, float(layer.scaling))


@dataclass
class FlashInferStep:
    """What plan() built for one step. FlashInfer's own plans live in its wrappers, which the backend keeps
    across steps; `planned` says which (path, signature) this step has planned so far."""

    meta: PagedKVMetadata
    host: HostCSR  # the indptrs FlashInfer's plan() reads on the host
    planned: set = field(default_factory=set)
    prefix_meta: PagedKVMetadata | None = None  # the ragged path's cached prefixes, built at its first layer
    prefix_host: HostCSR | None = None
    graph_bs: int | None = None  # a decode graph's batch size: run its wrappers
    graph_verify: tuple[int, int] | None = None  # a verify graph's (batch size, q): run its wrappers


class FlashInferMHABackend(AttentionBackend):
    """FlashInfer over an MHA/GQA pool: paged decode, paged or ragged prefill."""

    name = "flashinfer"
    features = FEATURES

    def __init__(
        self,
        pool,
        workspace_mb: int = 256,
        use_tensor_cores: bool = True,
        prefill_kernel: str = "auto",
        prefill_path: str = "paged",
        q_dtype: torch.dtype | None = None,
        num_sms: int | None = None,
        **options,
    ):
        """
        workspace_mb: the float workspace's size to start with; the first graph capture grows it to what
            the graphs will need (workspace.py).
        prefill_kernel: "auto" (fa3 where it applies, else fa2), "fa2" or "fa3".
        prefill_path: "paged" (one paged causal pass) or "ragged" (new tokens ragged + prefix paged,
            merged by LSE; falls back to paged for sliding windows and custom masks).
        q_dtype: dtype of queries and outputs (default: the pool's, or bf16 for an FP8 pool).
        num_sms: the SM count FlashInfer's plans size their scratch by (default: the GPU's; a pool off CUDA
            with none given sizes nothing).
        """
        super().__init__(pool, **options)
        if pool.is_mla:
            raise ValueError("FlashInferMHABackend serves MHA/GQA pools; an MLA pool takes FlashInferMLABackend")
        if prefill_kernel not in ("auto", "fa2", "fa3"):
            raise ValueError(f"prefill_kernel must be auto, fa2 or fa3, got {prefill_kernel!r}")
        if prefill_path not in ("paged", "ragged"):
            raise ValueError(f"prefill_path must be paged or ragged, got {prefill_path!r}")
        self._fi = flashinfer_module()
        device = pool.device
        self.workspace = allocate_workspace(workspace_mb * MIB, device)
        self.num_sms = num_sms or device_sm_count(device)
        self.use_tensor_cores = use_tensor_cores
        self.prefill_path = prefill_path
        self.q_dtype = q_dtype or default_q_dtype(pool)
        self.prefill_kernel, self.prefill_kernel_reason = self._choose_prefill_kernel(prefill_kernel, device)
        self._signatures: list[_Signature] = []  # every layer signature seen, in order
        self._decode_wrappers: dict[_Signature, object] = {}
        self._prefill_wrappers: dict[tuple[str, _Signature], object] = {}
        self._ragged_wrappers: dict[tuple[str, _Signature], object] = {}
        self._graph_wrappers: dict[tuple, object] = {}  # (bs, sig) decode, ("verify", bs, q, sig) verify
        self._graph_buffers: MetadataBuffers | None = None
        self.graph_max_tokens = 0

    def _choose_prefill_kernel(self, requested: str, device: torch.device) -> tuple[str, str]:
        if requested != "auto":
            return requested, "requested explicitly"
        if device.type != "cuda":
            return "fa2", f"fa3 needs a Hopper GPU (this pool is on {device.type})"
        major, _ = torch.cuda.get_device_capability(device)
        cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
        if major != 9 or cuda < (12, 3):
            return "fa2", f"fa3 needs SM90 and CUDA >= 12.3 (this is sm{major}x, CUDA {cuda[0]}.{cuda[1]})"
        if self.pool.is_fp8:
            return "fa2", "FP8 KV with bf16/fp16 queries runs on fa2 (fa3 wants FP8 queries too)"
        if self.pool.head_dim != self.pool.v_head_dim or self.pool.head_dim not in (64, 128, 256):
            return "fa2", f"fa3 prefill is built for equal K/V widths of 64/128/256, got {self.pool.head_dim}"
        return "fa3", "Hopper (SM90, CUDA >= 12.3), equal K/V widths and no FP8 KV: FlashInfer's fa3 prefill applies"

    # ---- per step -------------------------------------------------------------------------------
    def plan(self, fb: ForwardBatch) -> FlashInferStep:
        """CSR metadata once per step; FlashInfer plans follow per layer signature (host side)."""
        return FlashInferStep(metadata_for_batch(fb), host_csr(fb.seq_lens_cpu, fb.extend_lens_cpu, self.pool.page_size))

    def _kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        k = pool.get_key_buffer(layer_id)  # [num_slots, Hkv, D]
        v = pool.get_value_buffer(layer_id)  # [num_slots, Hkv, Dv]
        ps = pool.page_size
        return (k.view(pool.num_pages, ps, k.shape[1], k.shape[2]),  # [num_pages, page_size, Hkv, D]
                v.view(pool.num_pages, ps, v.shape[1], v.shape[2]))

    def _scales(self, layer_id: int) -> dict:
        if not self.pool.is_fp8:
            return {}
        return {"k_scale": self.pool.k_scale[layer_id], "v_scale": self.pool.v_scale[layer_id]}

    def _remember(self, sig: _Signature) -> None:
        if sig not in self._signatures:
            self._signatures.append(sig)

    # ---- decode ------------------------------------------------------------------------------------
    def _new_decode_wrapper(self, bs: int | None = None):
        kw = {}
        if bs is not None:  # graph mode: fixed buffers, fixed batch size
            bufs = self._graph_buffers
            kw = {"use_cuda_graph": True, "paged_kv_indptr_buffer": bufs.kv_indptr[: bs + 1],
                  "paged_kv_indices_buffer": bufs.kv_indices,
                  "paged_kv_last_page_len_buffer": bufs.kv_last_page_len[:bs]}
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, **kw)

    def _plan_decode(self, wrapper, host: HostCSR, kv_indices: torch.Tensor, sig: _Signature) -> None:
        wrapper.plan(
            host.kv_indptr, kv_indices, host.kv_last_page_len, sig.num_heads, sig.num_kv_heads, sig.head_dim,
            self.pool.page_size, window_left=sig.window_left, logits_soft_cap=sig.logit_cap, sm_scale=sig.scale,
            q_data_type=self.q_dtype, kv_data_type=self.pool.dtype,
        )

    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch, meta: FlashInferStep) -> torch.Tensor:
        sig = _Signature.of(layer)
        self._remember(sig)
        if meta.graph_bs is not None:
            wrapper = self._graph_wrappers[(meta.graph_bs, sig)]
        else:
            wrapper = self._decode_wrappers.get(sig)
            if wrapper is None:
                wrapper = self._decode_wrappers[sig] = self._new_decode_wrapper()
            if ("decode", sig) not in meta.planned:
                self._plan_decode(wrapper, meta.host, meta.meta.kv_indices, sig)
                meta.planned.add(("decode", sig))
        return wrapper.run(q, self._kv_cache(layer.layer_id), **self._scales(layer.layer_id))  # [B, Hq, Dv]

    # ---- extend ------------------------------------------------------------------------------------
    def _kernel_for(self, fb: ForwardBatch) -> str:
        return "fa2" if fb.custom_mask is not None else self.prefill_kernel

    def _prefill_wrapper(self, table: dict, cls_name: str, kernel: str, sig: _Signature):
        key = (kernel, sig)
        if key not in table:
            table[key] = getattr(self._fi, cls_name)(self.workspace, "NHD", backend=kernel)
        return table[key]

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch, meta: FlashInferStep) -> torch.Tensor:
        sig = _Signature.of(layer)
        self._remember(sig)
        if meta.graph_verify is not None:
            wrapper = self._graph_wrappers[("verify", *meta.graph_verify, sig)]
            return wrapper.run(q, self._kv_cache(layer.layer_id), **self._scales(layer.layer_id))  # [T, Hq, Dv]
        use_ragged = (self.prefill_path == "ragged" and k is not None and v is not None
                      and fb.custom_mask is None and sig.window_left < 0)
        if use_ragged:
            return self._extend_ragged(q, k, v, layer, fb, meta, sig)
        kernel = self._kernel_for(fb)
        wrapper = self._prefill_wrapper(self._prefill_wrappers, "BatchPrefillWithPagedKVCacheWrapper", kernel, sig)
        if ("paged", sig) not in meta.planned:
            m = meta.meta
            # the custom-mask packer works on the mask's device, so that plan keeps device indptrs
            csr = m if fb.custom_mask is not None else meta.host
            wrapper.plan(
                csr.qo_indptr, csr.kv_indptr, m.kv_indices, csr.kv_last_page_len, sig.num_heads, sig.num_kv_heads,
                sig.head_dim, m.page_size, head_dim_vo=sig.v_head_dim, custom_mask=fb.custom_mask,
                causal=fb.custom_mask is None, sm_scale=sig.scale, window_left=sig.window_left,
                logits_soft_cap=sig.logit_cap, q_data_type=self.q_dtype, kv_data_type=self.pool.dtype,
            )
            meta.planned.add(("paged", sig))
        return wrapper.run(q, self._kv_cache(layer.layer_id), **self._scales(layer.layer_id))  # [T, Hq, Dv]

    def _extend_ragged(self, q, k, v, layer, fb: ForwardBatch, step: FlashInferStep, sig: _Signature) -> torch.Tensor:
        kernel = self._kernel_for(fb)
        ragged = self._prefill_wrapper(self._ragged_wrappers, "BatchPrefillWithRaggedKVCacheWrapper", kernel, sig)
        host = step.host
        if ("ragged", sig) not in step.planned:
            ragged.plan(host.qo_indptr, host.qo_indptr, sig.num_heads, sig.num_kv_heads, sig.head_dim,
                        head_dim_vo=sig.v_head_dim, causal=True, sm_scale=sig.scale,
                        logits_soft_cap=sig.logit_cap, q_data_type=self.q_dtype, kv_data_type=self.q_dtype)
            step.planned.add(("ragged", sig))
        o_new, lse_new = ragged.run(q, k.to(q.dtype), v.to(q.dtype), return_lse=True)  # [T, Hq, Dv], [T, Hq]
        if not any(fb.prefix_lens_cpu):
            return o_new
        if step.prefix_meta is None:
            step.prefix_meta = build_paged_metadata(
                fb.req_to_token, fb.req_pool_indices, fb.prefix_lens, fb.extend_lens, self.pool.page_size,
                seq_lens_cpu=fb.prefix_lens_cpu)
            step.prefix_host = host_csr(fb.prefix_lens_cpu, fb.extend_lens_cpu, self.pool.page_size)
        pm, ph = step.prefix_meta, step.prefix_host
        paged = self._prefill_wrapper(self._prefill_wrappers, "BatchPrefillWithPagedKVCacheWrapper", kernel, sig)
        if ("prefix", sig) not in step.planned:
            paged.plan(ph.qo_indptr, ph.kv_indptr, pm.kv_indices, ph.kv_last_page_len, sig.num_heads,
                       sig.num_kv_heads, sig.head_dim, pm.page_size, head_dim_vo=sig.v_head_dim, causal=False,
                       sm_scale=sig.scale, logits_soft_cap=sig.logit_cap, q_data_type=self.q_dtype,
                       kv_data_type=self.pool.dtype)
            step.planned.add(("prefix", sig))
            step.planned.discard(("paged", sig))  # the paged wrapper now holds the prefix plan
        o_pre, lse_pre = paged.run(q, self._kv_cache(layer.layer_id), return_lse=True, **self._scales(layer.layer_id))
        # requests without a prefix: their prefix side is empty, whatever the kernel wrote there
        no_prefix = torch.repeat_interleave(fb.prefix_lens == 0, fb.extend_lens.long(), output_size=q.shape[0])  # [T]
        lse_pre = lse_pre.masked_fill(no_prefix[:, None], float("-inf"))
        o_pre = o_pre.masked_fill(no_prefix[:, None, None], 0)
        out, _ = self._fi.merge_state(o_new, lse_new, o_pre, lse_pre)
        return out

    # ---- CUDA graphs (decode, verify chains) ---------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        """Index buffers now; the page-id buffer and the workspace are sized at the first capture.

        max_tokens: the most tokens a captured verify step holds (batch x q); decode graphs hold max_bs.
        """
        self.graph_max_bs = max_bs
        self.graph_max_tokens = max_tokens
        self._graph_buffers = MetadataBuffers.allocate(max_bs, 0, self.pool.device)

    # ---- the workspace graphs keep -----------------------------------------------------------------------
    def graph_scratch(self, sig: _Signature, batch_size: int, tokens: int, verify: bool) -> Scratch:
        """The float scratch a graph-mode plan of this signature takes: decode (tokens = batch_size) or verify."""
        if verify or self.use_tensor_cores:  # both run PrefillPlan (decode: one row a request)
            head_dim_vo = sig.v_head_dim if verify else sig.head_dim
            return prefill_graph_scratch(batch_size, tokens, sig.num_heads, sig.num_kv_heads, head_dim_vo,
                                         self.num_sms)
        return decode_graph_scratch(sig.num_heads, sig.num_kv_heads, sig.head_dim, self.num_sms)

    def graph_workspace_bytes(self, max_bs: int, max_tokens: int) -> int:
        """Workspace bytes every graph of the known signatures takes: decode up to max_bs requests, and verify
        chains of q tokens a request up to max_tokens tokens (bs x q, bs <= max_bs)."""
        need = 0
        for sig in self._signatures:
            for bs in range(1, max_bs + 1):
                need = max(need, self.graph_scratch(sig, bs, bs, verify=False).nbytes)
                q = max_tokens // bs
                if q >= 1:
                    need = max(need, self.graph_scratch(sig, bs, bs * q, verify=True).nbytes)
        return need

    def _size_workspace_for_capture(self, fb: ForwardBatch, verify: bool) -> None:
        if self.num_sms is None or not self._signatures:
            return
        bs, tokens = fb.batch_size, sum(fb.extend_lens_cpu)
        scratch = max((self.graph_scratch(sig, bs, tokens, verify) for sig in self._signatures),
                      key=lambda s: s.nbytes)
        what = f"a {'verify' if verify else 'decode'} graph of {bs} requests and {tokens} tokens"
        pinned = bool(self._graph_wrappers)
        bound = 0 if pinned else self.graph_workspace_bytes(self.graph_max_bs, self.graph_max_tokens)
        grown = graph_workspace(self.workspace, what, scratch, bound, pinned,
                                (self.graph_max_bs, self.graph_max_tokens))
        if grown is not None:
            self.workspace = grown
            # eager wrappers hold the old buffer: they are built again over this one when next used
            self._decode_wrappers.clear()
            self._prefill_wrappers.clear()
            self._ragged_wrappers.clear()

    def _new_verify_wrapper(self, bs: int):
        """A graph-mode paged prefill wrapper over the fixed buffers; fa2, whose graph mode takes every mask."""
        bufs = self._graph_buffers
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr[: bs + 1],
            paged_kv_indptr_buf=bufs.kv_indptr[: bs + 1], paged_kv_indices_buf=bufs.kv_indices,
            paged_kv_last_page_len_buf=bufs.kv_last_page_len[:bs], backend="fa2")

    def _plan_graph(self, fb: ForwardBatch, capture: bool) -> FlashInferStep:
        bs = fb.batch_size
        meta = graph_step_metadata(fb, self._graph_buffers, self.graph_max_bs, self.pool, bool(self._signatures),
                                   captured=bool(self._graph_wrappers), verify=True)
        if capture:
            self._size_workspace_for_capture(fb, verify=fb.mode is ForwardMode.TARGET_VERIFY)
        host = host_csr(fb.seq_lens_cpu, fb.extend_lens_cpu, self.pool.page_size)
        verify = (bs, fb.extend_lens_cpu[0]) if fb.mode is ForwardMode.TARGET_VERIFY else None
        for sig in self._signatures:
            if verify is None:
                key = (bs, sig)
                if key not in self._graph_wrappers:
                    self._graph_wrappers[key] = self._new_decode_wrapper(bs)
                self._plan_decode(self._graph_wrappers[key], host, meta.kv_indices, sig)
                continue
            key = ("verify", *verify, sig)
            if key not in self._graph_wrappers:
                self._graph_wrappers[key] = self._new_verify_wrapper(bs)
            self._graph_wrappers[key].plan(
                host.qo_indptr, host.kv_indptr, meta.kv_indices, host.kv_last_page_len, sig.num_heads,
                sig.num_kv_heads, sig.head_dim, self.pool.page_size, head_dim_vo=sig.v_head_dim, causal=True,
                sm_scale=sig.scale, window_left=sig.window_left, logits_soft_cap=sig.logit_cap,
                q_data_type=self.q_dtype, kv_data_type=self.pool.dtype,
            )
        return FlashInferStep(meta, host, graph_bs=None if verify else bs, graph_verify=verify)

    def plan_for_capture(self, fb: ForwardBatch) -> FlashInferStep:
        return self._plan_graph(fb, capture=True)

    def plan_for_replay(self, fb: ForwardBatch) -> FlashInferStep:
        return self._plan_graph(fb, capture=False)
