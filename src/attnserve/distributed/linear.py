"""Tensor-parallel linears: column-parallel (outputs split, no communication) and row-parallel
(inputs split, outputs summed by an all-reduce), as in Megatron-LM.

A column-parallel layer may stack several projections into one matmul (q|k|v, gate|up): each part
is split on its own (`units` says how: heads of a size, or single channels), so rank r's weight is
[q_r; k_r; v_r] and the model splits its output with `output_sizes` exactly as it does at tp 1.
A row-parallel layer takes the matching input slice (a rank's heads' outputs, its MLP channels)
and sums the partial products; its bias is added once, after the sum.

At tp 1 both are plain linears holding the whole weight. Loading goes through
`weight_loader(param, loaded, shard_id, name)`, which reads only the rank's slice of `loaded`
(a tensor or a lazy checkpoint tensor, see `shard.take`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.shard import UnitSlice, read_all, take, unit_slice
from attnserve.distributed.state import all_reduce, tp_rank, tp_size


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T (+ b_r): this rank's rows of each stacked part.

    output_sizes: the global size of each part (e.g. [Hq*D, Hkv*D, Hkv*D]); units: how many equal units
    each part splits into (e.g. [Hq, Hkv, Hkv]; default: one per element). replicable: the parts whose units
    ranks may share when tp exceeds them (K and V heads). replicate: every rank holds all of it (projections
    that are not split, like MLA's latent down-projection).
    """

    reads_slices = True  # the loader may hand a lazy checkpoint tensor
    cpu_matmul = None  # a models.cpu_weights.CPUMatmul once a CPU model's weights are packed

    def __init__(self, in_features: int, output_sizes: list[int], units: list[int] | None = None,
                 bias: bool = False, replicable: tuple[int, ...] = (), replicate: bool = False):
        super().__init__()
        units = list(output_sizes) if units is None else list(units)
        if len(units) != len(output_sizes) or any(s % u for s, u in zip(output_sizes, units)):
            raise ValueError(f"units {units} must match output_sizes {list(output_sizes)} part by part and divide them")
        rank, size = (0, 1) if replicate else (tp_rank(), tp_size())
        self.slices: list[UnitSlice] = [unit_slice(u, s // u, rank, size, allow_replicas=i in replicable)
                                        for i, (s, u) in enumerate(zip(output_sizes, units))]
        self.in_features = in_features
        self.output_sizes = [s.length for s in self.slices]  # this rank's size of each part
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)  # [out_r, in]
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int = 0, name: str = "") -> None:
        """Copy this rank's rows of checkpoint part `shard_id` (its [global part, in] weight or bias)."""
        s = self.slices[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        copy_checked(param.data.narrow(0, offset, s.length), take(loaded, 0, s.start, s.length), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_matmul is not None:
            return self.cpu_matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T (+ b): x_r is this rank's slice of the input features (its heads, its channels).

    reduce=False leaves the partial sum for the caller to reduce once (MoE sums its experts and shared
    experts first).
    """

    reads_slices = True
    cpu_matmul = None  # a models.cpu_weights.CPUMatmul once a CPU model's weights are packed (one rank only)

    def __init__(self, in_features: int, out_features: int, units: int | None = None, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        units = in_features if units is None else units
        if in_features % units:
            raise ValueError(f"units {units} must divide in_features {in_features}")
        self.slice = unit_slice(units, in_features // units, tp_rank(), tp_size())
        self.in_features = self.slice.length  # this rank's share of the input
        self.out_features = out_features
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features), requires_grad=False)  # [out, in_r]
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int = 0, name: str = "") -> None:
        if param is self.bias:
            copy_checked(param.data, read_all(loaded), name)
        else:
            copy_checked(param.data, take(loaded, 1, self.slice.start, self.slice.length), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_matmul is not None:
            return self.cpu_matmul(x, self.bias)
        y = F.linear(x, self.weight)
        if self.reduce:
            y = all_reduce(y)
        return y if self.bias is None else y + self.bias
