"""Building blocks shared by every model: norms, tensor-parallel-ready linears, gated MLP, embeddings.

Linears follow the Megatron split so tensor parallelism can be switched on later
without touching the models: a column-parallel linear shards its output features
across ranks, a row-parallel one shards its input features and would all-reduce
its output. Today world size is 1, so shards are whole tensors and the reduce is
a no-op. Weight loading goes through `weight_loader(param, tensor, shard_id)`, so
a fused projection (q|k|v, gate|up) can be filled from the separate checkpoint
tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.models.rope import RotaryEmbedding  # noqa: F401  (re-exported: models import layers from here)
from attnserve.ops import TORCH_OPS, OpSet

TP_SIZE = 1  # tensor-parallel world size; sharding code below is written for any size
TP_RANK = 0


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


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    if TP_SIZE == 1:
        return t
    size = t.shape[dim] // TP_SIZE
    return t.narrow(dim, TP_RANK * size, size)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks; `output_sizes` names fused parts.

    output_sizes: the global output width of each fused part (e.g. [q, k, v]); a checkpoint tensor
    for part i is sharded on its own and copied into that part's slice of the local weight.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = [s // TP_SIZE for s in output_sizes]
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        start = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        _copy_checked(param.data.narrow(0, start, size), _shard(loaded, 0), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's input columns split across ranks; partial sums are all-reduced (TP > 1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features // TP_SIZE
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        _copy_checked(param.data, _shard(loaded, 1) if param.dim() == 2 else loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        # TP > 1: all-reduce y here, before the bias is added once
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(ColumnParallelLinear):
    """A linear every rank holds whole (small projections such as MLA's down-projections, routers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        nn.Module.__init__(self)
        self.in_features = in_features
        self.output_sizes = [out_features]
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        _copy_checked(param.data, loaded, name)


def activation(name: str):
    acts = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in acts:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(acts)}")
    return acts[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate|up fused into one column-parallel matmul.

    SiLU (every Llama-family model) runs as the op set's silu_mul: one kernel on the GPU.
    """

    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.split_gate_up:  # two GEMMs over views of the merged weight (faster for fp32 on CPUs)
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            n = w.shape[0] // 2
            gate = F.linear(x, w[:n], None if b is None else b[:n])  # [T, intermediate/tp]
            up = F.linear(x, w[n:], None if b is None else b[n:])  # [T, intermediate/tp]
            return self.down_proj(self.act(gate) * up)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate/tp]
        if self.act is F.silu:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate/tp]
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


class VocabEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (each rank a contiguous id range)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + TP_SIZE - 1) // TP_SIZE
        self.vocab_start = TP_RANK * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)  # [V/tp, hidden]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        part = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        _copy_checked(param.data[: part.shape[0]], part, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if TP_SIZE == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_range[:, None]
        return out  # TP > 1: all-reduce across ranks


class LMHead(VocabEmbedding):
    """Hidden states -> logits over this rank's vocabulary shard (all-gathered when TP > 1)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)[:, : self.vocab_size]  # [T, V]
