"""Building blocks shared by every model: norms, the replicated linear, gated MLP.

Weight loading goes through `weight_loader(param, tensor, shard_id)`, so a fused
projection (q|k|v, gate|up) can be filled from the separate checkpoint tensors.
The tensor-parallel linears and embeddings (each rank holding its slice, row-parallel
outputs all-reduced) live in `attnserve.distributed`; at tp 1 they are plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.linear import ColumnParallelLinear, RowParallelLinear
from attnserve.models.rope import RotaryEmbedding  # noqa: F401  (re-exported: models import layers from here)


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Linear(ColumnParallelLinear):
    """y = x W^T (+ b), held whole by every rank (projections tensor parallelism does not split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, [out_features], bias=bias, replicate=True)


def activation(name: str):
    acts = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in acts:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(acts)}")
    return acts[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate|up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 reduce_results: bool = True):
        """Under tensor parallelism each rank holds intermediate_size / tp channels of gate and of up, and
        down's matching columns; reduce_results=False leaves the partial sum to the caller."""
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce=reduce_results)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [T, intermediate]
        return self.down_proj(self.act(gate) * up)
