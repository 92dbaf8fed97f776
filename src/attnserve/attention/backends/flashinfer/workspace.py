"""FlashInfer's float workspace: what each plan carves out of it, and the size that holds every captured plan.

A wrapper's plan() lays its split-KV scratch out in the float workspace from offset 0, each buffer 16-byte
aligned (AlignedAllocator, include/flashinfer/attention/scheduler.cuh); a plan that does not fit fails with
"Buffer overflow when allocating memory for batch_prefill_tmp_v ...". Every wrapper of a backend shares the
one workspace and the kernels run one after another, so it must hold the largest single plan. CUDA graphs
keep its address: it is sized for every graph the backend will capture before the first one is, and a later
capture that needs more is refused.

The sizes follow FlashInfer 0.6's scheduler, on SM80 and newer:

- Paged prefill / verify (fa2, `PrefillPlan`), and decode on tensor cores (the same plan, one query row a
  request): under CUDA graphs split-KV is always on, and with group = num_qo_heads / num_kv_heads,
  cta_tile_q = FA2DetermineCtaTileQ((rows - batch + 1) * group, head_dim_vo),
  padded_batch = max(2 * num_sms // num_kv_heads, ceil(rows * group / cta_tile_q) + batch - 1),
  batch_prefill_tmp_v = num_qo_heads * padded_batch * cta_tile_q * head_dim_vo * 4 bytes and
  batch_prefill_tmp_s = num_qo_heads * padded_batch * cta_tile_q * 4 bytes. The batch and its total rows
  (tokens) enter; the requests' KV lengths do not, so one size holds every replay of a graph.
- Decode on CUDA cores (`DecodePlan`): padded_batch = blocks_per_sm * num_sms // num_kv_heads,
  batch_decode_tmp_v = num_qo_heads * padded_batch * head_dim * 4 bytes (tmp_s without head_dim).
  blocks_per_sm is the kernel's occupancy; the bound takes its ceiling, 16 (2048 threads an SM, at least
  128 a block).
- MLA (`MLAPlan`): mla_partial_o = 2 * num_clusters * cluster_tile_q * 2 * kv_lora_rank bytes and
  mla_partial_lse = 2 * num_clusters * cluster_tile_q * 4 bytes, num_clusters * cluster_tile_q at most
  64 * num_sms (one or two 64-row CTAs a cluster). Neither the batch nor the heads enter.

`fa3` prefill (`PrefillSM90Plan`) takes no float scratch; the backends capture graphs on fa2 plans only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT32_BYTES = 4
ALIGNMENT = 16  # every aligned_alloc_offset of the float workspace
PREFILL_BLOCKS_PER_SM = 2  # PrefillPlan's num_blocks_per_sm
DECODE_MAX_BLOCKS_PER_SM = 16  # 2048 resident threads an SM / the decode kernel's at least 128 a block
MLA_CTA_TILE_Q = 64
MLA_OUT_BYTES = 2  # MLAPlan sizes its partial outputs as fp16/bf16
MIB = 1 << 20


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Scratch:
    """The two float buffers one plan takes from the workspace, named as FlashInfer names them."""

    names: tuple[str, str]
    tmp_bytes: int  # the partial outputs (tmp_v / partial_o)
    lse_bytes: int  # their log-sum-exps (tmp_s / partial_lse)

    @property
    def nbytes(self) -> int:
        """Workspace bytes the plan lays out: the first buffer at offset 0, the second 16-byte aligned after it."""
        return _aligned(self.tmp_bytes) + self.lse_bytes

    def describe(self) -> str:
        return f"{self.names[0]} {self.tmp_bytes} + {self.names[1]} {self.lse_bytes} bytes"


def fa2_cta_tile_q(packed_qo_len: int, head_dim_vo: int) -> int:
    """FlashInfer's FA2DetermineCtaTileQ on SM80 and newer."""
    if packed_qo_len > 64 and head_dim_vo < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def prefill_graph_scratch(batch_size: int, total_rows: int, num_qo_heads: int, num_kv_heads: int,
                          head_dim_vo: int, num_sms: int) -> Scratch:
    """A graph-mode fa2 PrefillPlan of batch_size requests and total_rows query rows (tokens) in all."""
    if batch_size < 1 or total_rows < batch_size:
        raise ValueError(f"a plan needs at least one row a request, got {total_rows} rows for {batch_size} requests")
    group = num_qo_heads // num_kv_heads
    cta = fa2_cta_tile_q((total_rows - batch_size + 1) * group, head_dim_vo)
    tiles = math.ceil(total_rows * group / cta) + batch_size - 1
    padded = max(PREFILL_BLOCKS_PER_SM * num_sms // num_kv_heads, tiles)
    rows = num_qo_heads * padded * cta
    return Scratch(("batch_prefill_tmp_v", "batch_prefill_tmp_s"), rows * head_dim_vo * FLOAT32_BYTES,
                   rows * FLOAT32_BYTES)


def decode_graph_scratch(num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> Scratch:
    """A graph-mode DecodePlan on CUDA cores (any batch size), at the kernel's highest possible occupancy."""
    padded = DECODE_MAX_BLOCKS_PER_SM * num_sms // num_kv_heads
    return Scratch(("batch_decode_tmp_v", "batch_decode_tmp_s"), num_qo_heads * padded * head_dim * FLOAT32_BYTES,
                   num_qo_heads * padded * FLOAT32_BYTES)


def mla_scratch(kv_lora_rank: int, num_sms: int) -> Scratch:
    """An MLAPlan (any batch, any heads): the larger of its one- and two-CTA cluster layouts."""
    rows = max((num_sms // cluster) * cluster * MLA_CTA_TILE_Q for cluster in (1, 2))
    return Scratch(("mla_partial_o", "mla_partial_lse"), 2 * rows * MLA_OUT_BYTES * kv_lora_rank,
                   2 * rows * FLOAT32_BYTES)


def device_sm_count(device: torch.device) -> int | None:
    """The GPU's SM count, which FlashInfer's plans size their scratch by; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def with_margin(nbytes: int) -> int:
    """nbytes and one sixteenth more, in whole MiB: room for a FlashInfer whose scratch is slightly larger."""
    return -(-(nbytes + nbytes // 16) // MIB) * MIB


def allocate_workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """FlashInfer's float scratch buffer, shared by every wrapper of one backend."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)  # [bytes]


def graph_workspace(workspace: torch.Tensor, what: str, scratch: Scratch | None, bound: int, pinned: bool,
                    declared: tuple[int, int]) -> torch.Tensor | None:
    """Before a capture: a larger workspace to move to (None: the current one holds it), or ValueError.

    scratch: what this capture's plan takes (None: nothing is known yet). bound: what every graph the
    backend was told of (`declared` = init_graph_buffers' max_bs, max_tokens) takes. pinned: graphs already
    hold the workspace's address, so it cannot move.
    """
    have = workspace.numel()
    need = scratch.nbytes if scratch is not None else 0
    if not pinned:
        want = max(need, bound)
        return allocate_workspace(with_margin(want), workspace.device) if want > have else None
    if need > have:
        raise ValueError(
            f"flashinfer: {what} needs {need} bytes of FlashInfer workspace ({scratch.describe()}), more than the "
            f"{have} bytes sized at the first capture for init_graph_buffers(max_bs={declared[0]}, "
            f"max_tokens={declared[1]}); graphs captured since keep its address. Declare the largest captured "
            f"step in init_graph_buffers, or pass a larger workspace_mb")
    return None
