"""Building blocks shared by every model: norms, linears (fused or not), gated MLP, embeddings.

Weight loading goes through `weight_loader(param, tensor, shard_id)`, so a fused
projection (q|k|v, gate|up) can be filled from the separate checkpoint tensors.
Every module holds its whole weight: tensor parallelism (sharding these and
reducing their outputs) is tracked in its own issue and is not written here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class MergedLinear(nn.Module):
    """y = x W^T (+ b), where W stacks several projections (`output_sizes`, e.g. [q, k, v]) into one matmul.

    The checkpoint holds each part as its own tensor; `weight_loader(..., shard_id=i)` copies part i
    into its rows of the fused weight.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        start = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        _copy_checked(param.data.narrow(0, start, size), loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Linear(MergedLinear):
    """y = x W^T (+ b): one projection, loaded from one checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, [out_features], bias)


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

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.split_gate_up:  # two GEMMs over views of the merged weight (faster for fp32 on CPUs)
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


class VocabEmbedding(nn.Module):
    """Token embedding: ids [T] -> rows of a [vocab, hidden] table."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)  # [V, hidden]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0, name: str = "") -> None:
        _copy_checked(param.data, loaded, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Hidden states -> logits over the vocabulary (the embedding table's shape; tied to it if the model says so)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [T, V]
