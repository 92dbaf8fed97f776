"""KV storage: the request->slot table and per-layer K/V buffers.

A slot is one token's place in the pool: slot = page * page_size + offset.
Backends read the buffers directly in the pool's layout
(`[num_slots, kv_heads, head_dim]`); FP8 pools store `x / scale` and readers
multiply by the layer's scale.
"""

from __future__ import annotations

import numpy as np
import torch

from attnserve.kvcache.dtypes import FP8_DTYPES, parse_kv_dtype
from attnserve.shape import AttentionShape
from attnserve.transfers import to_device


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 1, got {page_size!r}")


class ReqToTokenPool:
    """Row per live request; row[i] is the slot of the request's i-th token.

    The pool is the one owner of the table's bookkeeping: it knows how many entries of each row are
    written (`filled`), so the runner appends a step's new slots without tracking that on the request.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"):
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs and max_context_len must be >= 1, got {max_reqs}, {max_context_len}")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._filled = [0] * max_reqs  # entries of each row written so far, from position 0

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"all {self.max_reqs} request rows are in use")
        row = self._free_rows.pop()
        self._filled[row] = 0
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_reqs or row in self._free_rows:
            raise ValueError(f"request row {row} is not allocated")
        self._filled[row] = 0
        self._free_rows.append(row)

    def filled(self, row: int) -> int:
        """How many leading entries of `row` hold slots (the next write starts there)."""
        return self._filled[row]

    def extend(self, rows: list[int], slots: list[np.ndarray]) -> None:
        """Append `slots[i]` to row `rows[i]` after the entries it holds, for a whole batch in one copy.

        Checked before anything is written: a row that would pass max_context_len leaves the table as it was.
        """
        self.write_at(rows, [self._filled[r] for r in rows], slots)

    def write_at(self, rows: list[int], starts: list[int], slots: list[np.ndarray]) -> None:
        """Write `slots[i]` into row `rows[i]` from entry `starts[i]` on (what `extend` computed on the rank that
        schedules; a tensor-parallel rank that only runs steps is told the starts). Checked before writing."""
        if not len(rows) == len(starts) == len(slots):
            raise ValueError(f"{len(rows)} rows, {len(starts)} starts but {len(slots)} slot lists")
        counts = [len(s) for s in slots]
        for row, start, n in zip(rows, starts, counts):
            if start + n > self.max_context_len:
                raise ValueError(f"request row {row}: {start + n} tokens exceed max_context_len {self.max_context_len}")
        if not sum(counts):
            return
        total = sum(counts)
        packed = np.empty((3, total), dtype=np.int64)  # row, position, slot of every new entry
        packed[0] = np.repeat(np.asarray(rows, dtype=np.int64), counts)
        packed[1] = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, counts)])
        packed[2] = np.concatenate([np.asarray(s, dtype=np.int64) for s in slots])
        idx = to_device(packed, self.req_to_token.device)  # [3, total]: one copy that never waits for the device
        self.req_to_token[idx[0], idx[1]] = idx[2].to(torch.int32)
        for row, start, n in zip(rows, starts, counts):
            self._filled[row] = start + n


class KVPool:
    """Common part of the MHA and MLA pools: geometry, dtype, scales, slot checks."""

    is_mla = False

    def __init__(self, num_pages: int, page_size: int, num_layers: int, dtype, device):
        check_page_size(page_size)
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_layers = num_layers
        self.dtype = parse_kv_dtype(dtype)
        self.device = torch.device(device)
        self.is_fp8 = self.dtype in FP8_DTYPES
        # per-layer dequantisation scales (1.0 unless an FP8 checkpoint or calibration sets them)
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers

    def buffers(self) -> list[torch.Tensor]:
        """Every per-layer buffer, each `[num_slots, heads, width]`."""
        raise NotImplementedError

    @property
    def bytes_per_token(self) -> int:
        """What one token occupies across all layers, measured from the buffers this pool allocated
        (the calculator's formula, `kvcache.calc.kv_bytes_per_token`, is tested against it)."""
        return sum(b[0].numel() * b.element_size() for b in self.buffers())

    def set_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self.k_scale[layer_id] = float(k_scale)
        self.v_scale[layer_id] = float(v_scale)

    def _check_store(self, layer_id: int, loc: torch.Tensor, x: torch.Tensor, shape_tail, what: str) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id {layer_id} out of range [0, {self.num_layers})")
        if loc.dtype.is_floating_point or loc.dtype.is_complex or loc.dtype == torch.bool:
            raise ValueError(f"out_cache_loc must hold integer slots, got dtype {loc.dtype}")
        if loc.dim() != 1 or loc.numel() != x.shape[0]:
            raise ValueError(f"out_cache_loc has {tuple(loc.shape)} but {what} has {x.shape[0]} tokens")
        if tuple(x.shape[1:]) != tuple(shape_tail):
            raise ValueError(f"{what} shape {tuple(x.shape)} does not match pool [tokens, {', '.join(map(str, shape_tail))}]")
        # on a GPU the range check would cost a device sync per layer (and break graph capture)
        if loc.device.type == "cpu":
            self.check_slots(loc)

    def check_slots(self, loc: torch.Tensor) -> None:
        if loc is getattr(self, "_checked_loc", None):
            return  # every layer of a step stores at the same slots: checked once (held, so its id is not reused)
        self._checked_loc = None
        if loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= self.num_slots):
            raise ValueError(f"out_cache_loc has slots outside [0, {self.num_slots})")
        self._checked_loc = loc

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if x.dtype == self.dtype and not self.is_fp8:
            return x
        if self.is_fp8:
            fmax = torch.finfo(self.dtype).max
            return (x.float() / scale).clamp(-fmax, fmax).to(self.dtype)
        return x.to(self.dtype)

    def dequantize(self, x: torch.Tensor, scale: float, dtype=torch.float32) -> torch.Tensor:
        """Read a slice of a buffer back in a compute dtype."""
        if self.is_fp8:
            return x.to(dtype) * scale
        return x.to(dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V (or latent) rows from slots `src` to slots `dst` ([N] int64 each).

        Speculative decoding compacts an accepted draft branch this way. Each buffer's `src` rows are
        read whole before any `dst` row is written, so the two lists may overlap."""
        if src.shape != dst.shape:
            raise ValueError(f"copy_slots: {src.numel()} sources for {dst.numel()} destinations")
        if not src.numel():
            return
        for buf in self.buffers():
            buf[dst] = buf[src]

    def slots_of_pages(self, pages) -> torch.Tensor:
        """All slots of the given pages, in order: [len(pages) * page_size]."""
        pages = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        offs = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offs[None, :]).reshape(-1)


class MHAKVPool(KVPool):
    """Per layer K `[num_slots, kv_heads, head_dim]` and V `[num_slots, kv_heads, v_head_dim]`."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype="bf16",
        device="cpu",
    ):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.k_buffer = [
            torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]  # each [num_slots, kv_heads, head_dim]
        self.v_buffer = [
            torch.zeros(self.num_slots, num_kv_heads, self.v_head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]  # each [num_slots, kv_heads, v_head_dim]

    def buffers(self) -> list[torch.Tensor]:
        return [*self.k_buffer, *self.v_buffer]

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_store(layer_id, loc, k, (self.num_kv_heads, self.head_dim), "k")
        self._check_store(layer_id, loc, v, (self.num_kv_heads, self.v_head_dim), "v")
        loc = loc.long()
        # quantize both before writing either: a failure leaves nothing half-written
        kq = self._quantize(k, self.k_scale[layer_id])
        vq = self._quantize(v, self.v_scale[layer_id])
        if self.is_fp8:  # index_copy_ has no FP8 kernel on the CPU
            self.k_buffer[layer_id][loc] = kq
            self.v_buffer[layer_id][loc] = vq
        else:
            self.k_buffer[layer_id].index_copy_(0, loc, kq)
            self.v_buffer[layer_id].index_copy_(0, loc, vq)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]


class MLAKVPool(KVPool):
    """One latent buffer per layer `[num_slots, 1, kv_lora_rank + rope_dim]`.

    K is the whole row (compressed latent + decoupled RoPE key); V is a view of
    its first kv_lora_rank columns, so nothing is stored twice.
    """

    is_mla = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype="bf16",
        device="cpu",
    ):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.kv_buffer = [
            torch.zeros(self.num_slots, 1, self.head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]  # each [num_slots, 1, kv_lora_rank + rope_dim]

    def buffers(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k is the latent row `[tokens, 1, kv_lora_rank + rope_dim]`; v is ignored (a view of k)."""
        self._check_store(layer_id, loc, k, (1, self.head_dim), "latent kv")
        self.kv_buffer[layer_id][loc.long()] = self._quantize(k, self.k_scale[layer_id])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def set_scales(self, layer_id: int, k_scale: float, v_scale: float | None = None) -> None:
        # V is a view of K: one scale serves both
        super().set_scales(layer_id, k_scale, k_scale)


def make_pool(shape: AttentionShape, num_pages: int, page_size: int, dtype="bf16", device="cpu") -> KVPool:
    """The pool a model of this shape needs: per-layer K and V for MHA/GQA, one latent buffer for MLA."""
    if shape.is_mla:
        return MLAKVPool(num_pages, page_size, shape.num_layers, shape.kv_lora_rank, shape.qk_rope_head_dim,
                         dtype=dtype, device=device)
    return MHAKVPool(num_pages, page_size, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.v_head_dim,
                     dtype=dtype, device=device)
