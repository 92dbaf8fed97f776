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
from attnserve.ops import TORCH_OPS, OpSet


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as the reference implementations do.

    Called with a residual it first adds it (`x + residual`, the residual stream of a
    pre-norm block) and returns (normed, sum): one fused kernel on the GPU.
    """

    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


def use_ops(model: nn.Module, ops: OpSet) -> None:
    """Make every module of `model` that runs a fusable op (norms, MLPs, the RoPE step) use `ops`."""
    for module in model.modules():
        if hasattr(type(module), "ops"):
            module.ops = ops


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
    """down(act(gate(x)) * up(x)), with gate|up fused into one matmul.

    SiLU (every Llama-family model) runs as the op set's silu_mul: one kernel on the GPU.
    """

    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 reduce_results: bool = True):
        """Under tensor parallelism each rank holds intermediate_size / tp channels of gate and of up, and
        down's matching columns; reduce_results=False leaves the partial sum to the caller."""
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce=reduce_results)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.split_gate_up and self.gate_up_proj.cpu_matmul is None:  # two GEMMs over views of the merged weight (faster for fp32 on CPUs)
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            n = w.shape[0] // 2
            gate = F.linear(x, w[:n], None if b is None else b[:n])  # [T, intermediate]
            up = F.linear(x, w[n:], None if b is None else b[n:])  # [T, intermediate]
            return self.down_proj(self.act(gate) * up)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.act is F.silu:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate]
        return self.down_proj(self.act(gate) * up)


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with each residual add deferred into the next norm.

    Subclasses build `input_layernorm`, `self_attn(positions, hidden, fb, rope)`,
    `post_attention_layernorm` and `mlp`. The layer takes the previous block's output and the
    residual stream and returns both, so every add + RMSNorm pair runs as one fused op; the
    first layer gets the embeddings with residual None, and the model's final norm adds the last.
    """

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, fb, rope):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
