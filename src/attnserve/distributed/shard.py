"""Which slice of a weight each tensor-parallel rank holds, and reading only that slice.

A sharded dimension is a number of equal units (attention heads, or single
intermediate channels). Rank r of n holds units [first, first + count):

    units % n == 0: count = units / n, first = r * count          (the usual split)
    n % units == 0: count = 1, first = r * units // n             (KV heads replicated when tp > KV heads)

The same formula serves query heads, KV heads, MLA heads, MLP and expert channels.

Checkpoint readers may hand the loaders a lazy tensor (anything with `shape` and
`narrow(dim, start, length) -> Tensor`, plus `read()` for all of it) so a rank
reads only its slice from disk; `take` and `read_all` accept both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UnitSlice:
    first: int  # first unit this rank holds
    count: int  # units this rank holds
    unit_size: int  # elements per unit along the sharded dim

    @property
    def start(self) -> int:
        return self.first * self.unit_size

    @property
    def length(self) -> int:
        return self.count * self.unit_size


def check_split(units: int, size: int, what: str, allow_replicas: bool = False) -> None:
    """Raise unless `units` split evenly over `size` ranks (or, where replicas are allowed, each rank can hold
    one replica: KV heads, which nothing sums over ranks; split query heads or channels are summed, so a
    replica there would be counted twice)."""
    if size < 1:
        raise ValueError(f"tp size must be >= 1, got {size}")
    if units % size and not allow_replicas:
        raise ValueError(f"tp size {size} does not divide the {units} {what}; allowed tp sizes: divisors of {units}")
    if units % size and size % units:
        raise ValueError(f"tp size {size} does not divide the {units} {what} (and is not a multiple of it); "
                         f"allowed tp sizes: divisors of {units}" + (f" or multiples of {units}" if units > 1 else ""))


def unit_slice(units: int, unit_size: int, rank: int, size: int, what: str = "units",
               allow_replicas: bool = False) -> UnitSlice:
    """The units of a dimension made of `units` x `unit_size` elements that rank `rank` of `size` holds."""
    check_split(units, size, what, allow_replicas)
    if units % size == 0:
        count = units // size
        return UnitSlice(rank * count, count, unit_size)
    return UnitSlice(rank * units // size, 1, unit_size)


def take(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """`loaded.narrow(dim, start, length)` for a tensor or a lazy checkpoint tensor (which reads only that)."""
    if tuple(loaded.shape)[dim] < start + length:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} has no [{start}, {start + length}) "
                         f"along dim {dim}")
    return loaded.narrow(dim, start, length)


def read_all(loaded) -> torch.Tensor:
    """The whole tensor, read from disk if it is a lazy checkpoint tensor."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


def check_model_splits(cfg, size: int) -> None:
    """Refuse a tp size that does not split this model (`cfg`: a parsed ModelConfig), naming what it fails on."""
    check_split(cfg.num_heads, size, "query heads")
    if not cfg.is_mla:
        check_split(cfg.num_kv_heads, size, "KV heads", allow_replicas=True)
    if cfg.intermediate_size:
        check_split(cfg.intermediate_size, size, "MLP channels (intermediate_size)")
    if cfg.n_routed_experts:
        check_split(cfg.moe_intermediate_size, size, "expert channels (moe_intermediate_size)")
