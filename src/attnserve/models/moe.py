"""DeepSeek mixture-of-experts in plain PyTorch: a router, routed experts, shared experts.

Expert weights live in two stacked tensors, which the fused MoE kernel reads in
place (the checkpoint mapping is the same for every path). Routing follows
the two published schemes: V2's softmax scores (greedy or group-limited top-k)
and V3's sigmoid scores with a bias used only for choosing (noaux_tc).

Which expert path runs, and where it is safe inside a CUDA graph (no host sync):
- where the model's op set has the fused MoE kernel (Triton on CUDA, unless `--disable-fused-ops`), every
  batch goes through it (ops/kernels/fused_moe.py): two grouped GEMMs over the pairs aligned by expert, SiLU x
  up and the routing weights in their epilogues, only the chosen experts' weights read, the shared experts
  run as more experts of the same two GEMMs. Graph-safe at any size.
  Otherwise (the CPU, a GPU without Triton, and the oracles of that kernel):
- fewer (token, choice) pairs than experts (decode): a grouped GEMM over the pairs
  sorted by expert reads only the chosen experts' weights in place. Graph-safe on
  CUDA where torch's grouped GEMM has its device kernel (SM90/SM100, bf16, widths
  a multiple of 8); elsewhere it would sync, so there a captured step takes the
  dense path and an eager step the per-expert loop.
- up to DENSE_MAX_PAIRS token x expert pairs: every expert on every token, graph-safe; except on a GPU
  with the grouped GEMM's device kernel, where from GROUPED_MIN_PAIRS pairs on the grouped GEMM is faster
  (prefill included: one GEMM per projection, no host sync).
- larger batches elsewhere (prefill): a loop over the experts chosen, which syncs per expert.
No path copies expert weights per token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.linear import copy_checked
from attnserve.distributed.shard import take, unit_slice
from attnserve.distributed.state import all_reduce, tp_rank, tp_size
from attnserve.models.config import ModelConfig
from attnserve.models.layers import GatedMLP, activation
from attnserve.ops import TORCH_OPS, OpSet

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class Router(nn.Module):
    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops
    # up to this many tokens the op set's routing kernel runs (each token's logits split over up to 16 programs
    # that read the router's weights from L2); prefill-sized batches keep the GEMM
    ROUTE_KERNEL_MAX_TOKENS = 128

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {cfg.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
        if cfg.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {cfg.scoring_func!r}; supported: softmax, sigmoid")
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.method = cfg.topk_method
        self.scoring = cfg.scoring_func
        self.n_group = max(cfg.n_group or 1, 1)
        self.topk_group = max(cfg.topk_group or 1, 1)
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        # routing runs in float32 whatever the model dtype: near-tied expert scores must pick the experts the
        # checkpoint's authors saw (V3 ships its correction bias in float32 for this reason)
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, cfg.hidden_size, dtype=torch.float32), requires_grad=False
        )  # [E, hidden]
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)
            if self.method == "noaux_tc" else None
        )  # [E]

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: experts inside the topk_group best groups."""
        top_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)  # [T, n_group]
        per_group = self.num_experts // self.n_group
        return group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts).bool()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        if (self.ops.moe_route is not None and self.method == "greedy" and x.shape[0] <= self.ROUTE_KERNEL_MAX_TOKENS
                and x.stride(-1) == 1):
            return self.ops.moe_route(x, self.weight, self.top_k, self.scoring == "softmax", self.norm_topk_prob,
                                      self.routed_scaling_factor)
        logits = F.linear(x.float(), self.weight)  # [T, E]
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        per_group = self.num_experts // self.n_group
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        else:
            if self.method == "group_limited_greedy":
                group_scores = scores.view(-1, self.n_group, per_group).amax(-1)  # [T, n_group]
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:  # V2-Lite's is 1: no launch for an exact no-op
            weights = weights * self.routed_scaling_factor
        return weights, ids


class Experts(nn.Module):
    """E gated MLPs as stacked weights: gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I].

    Tensor-parallel experts: every rank holds every expert, with I / tp of its channels (gate's and up's
    rows, down's columns), so its output is a partial sum the MoE layer all-reduces.
    """

    reads_slices = True  # the loader may hand a lazy checkpoint tensor
    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.num_experts = num_experts
        self.channels = unit_slice(intermediate_size, 1, tp_rank(), tp_size(), "expert channels")
        intermediate_size = self.channels.length  # this rank's share
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )  # [E, 2I, hidden]
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )  # [E, hidden, I]
        self.act = activation(hidden_act)
        # parts the loader must see: gate and up of every expert, down of every expert
        self.weight_parts = {"gate_up_proj": 2 * num_experts, "down_proj": num_experts}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int, name: str = "") -> None:
        """part -1: the stacked tensor whole; else gate_up part 2e (gate) / 2e+1 (up), down part e.

        Only this rank's channels are read: rows of gate and of up, columns of down."""
        start, n = self.channels.start, self.channels.length
        if part == -1 and param is self.gate_up_proj:  # [E, 2I, hidden]: this rank's gate rows, then its up rows
            half = tuple(loaded.shape)[1] // 2
            loaded = torch.cat((take(loaded, 1, start, n), take(loaded, 1, half + start, n)), dim=1)
            target = param.data
        elif part == -1:  # down [E, hidden, I]
            loaded, target = take(loaded, 2, start, n), param.data
        elif param is self.gate_up_proj:
            expert, half = divmod(part, 2)
            target = param.data[expert, half * n : (half + 1) * n]
            loaded = take(loaded, 0, start, n)  # [I_r, hidden]
        else:
            target = param.data[part]
            loaded = take(loaded, 1, start, n)  # [hidden, I_r]
        copy_checked(target, loaded, name)

    # below this many token x expert pairs every expert runs on every token (weighted by 0 where unrouted):
    # no host sync, so decode steps can be captured in a CUDA graph, and small batches read each expert's
    # weights once either way
    DENSE_MAX_PAIRS = 16384
    # from this many pairs up, one grouped GEMM over the routed tokens beats a dense bmm over every expert on
    # the GPU; below it the dense bmm reads each expert's weights once for the whole batch and is faster
    GROUPED_MIN_PAIRS = 8192

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: GatedMLP | None = None) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden], plus the shared experts' output where given. The fused
        kernel runs shared experts as more experts of its two GEMMs where their weights allow (shared_fits), else
        adds their output in the pass that sums the top-k."""
        if self.fused_applies(x):
            if shared is not None and self.shared_fits(shared, x):
                return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                          shared_gate_up=shared.gate_up_proj.weight,
                                          shared_down=shared.down_proj.weight)
            return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                      add=None if shared is None else shared(x))
        out = self._forward_torch(x, weights, ids)
        return out if shared is None else out + shared(x)

    def shared_fits(self, shared: GatedMLP, x: torch.Tensor) -> bool:
        """Whether the shared MLP is S experts of this width: SiLU, no bias, its channels a multiple of ours,
        plain weights in x's dtype (DeepSeek's n_shared_experts x moe_intermediate_size always is)."""
        gate_up, down = shared.gate_up_proj, shared.down_proj
        return (shared.act is F.silu and gate_up.bias is None and down.bias is None
                and gate_up.cpu_matmul is None and down.cpu_matmul is None
                and down.weight.shape[1] % self.intermediate_size == 0
                and gate_up.weight.dtype == down.weight.dtype == x.dtype
                and gate_up.weight.stride(-1) == 1 and down.weight.stride(-1) == 1)

    def _forward_torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        few = ids.numel() < self.num_experts  # a few tokens: read only the chosen experts
        pairs = x.shape[0] * self.num_experts
        if self.grouped_mm_applies(x) and (few or (pairs >= self.GROUPED_MIN_PAIRS and _on_gpu(x))):
            return self.forward_grouped(x, weights, ids)
        if few and not _capturing(x):
            return self.forward_sparse(x, weights, ids)
        if pairs <= self.DENSE_MAX_PAIRS:
            return self.forward_dense(x, weights, ids)
        return self.forward_sparse(x, weights, ids)

    def fused_applies(self, x: torch.Tensor) -> bool:
        """Whether the op set's fused MoE kernel runs this batch: it computes SiLU experts in one dtype."""
        return (self.ops.fused_moe is not None and self.act is F.silu and x.dtype == self.gate_up_proj.dtype
                and x.stride(-1) == 1)

    def grouped_mm_applies(self, x: torch.Tensor) -> bool:
        """Whether forward_grouped runs here without a host sync (so inside CUDA graphs too)."""
        if not hasattr(torch, "_grouped_mm") or x.dtype != self.gate_up_proj.dtype:
            return False
        if x.device.type == "cpu":  # torch's reference loop: syncs nothing that matters on the host
            return True
        return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and _grouped_mm_device_kernel(x.device)
                and x.shape[-1] % 8 == 0 and self.intermediate_size % 8 == 0)  # 16-byte aligned rows

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The (token, choice) pairs sorted by expert, through one grouped GEMM per projection.

        The GEMM reads each chosen expert's weights where they lie; only activations are gathered.
        Every shape depends on the batch size alone and the group ends are computed on the device.
        """
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)  # [P = T*k]
        order = torch.argsort(flat, stable=True)  # [P], pairs grouped by expert
        experts = torch.arange(self.num_experts, device=ids.device)  # [E]
        group_ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # [E]
        xs = x[order // top_k]  # [P, hidden]
        gate_up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=group_ends)  # [P, 2I]
        gate, up = gate_up.chunk(2, dim=-1)  # each [P, I]
        y_sorted = torch._grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=group_ends)  # [P, hidden]
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)  # [P, hidden], back in (token, choice) order
        y = y.view(tokens, top_k, -1) * weights.unsqueeze(-1)  # [T, k, hidden] float32
        return y.sum(1).to(x.dtype)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        # [T, E] routing weights, zero for experts a token does not use
        routing = torch.zeros(tokens, self.num_experts, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        xe = x.unsqueeze(0).expand(self.num_experts, tokens, x.shape[1])  # [E, T, hidden]
        gate, up = torch.bmm(xe, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # each [E, T, I]
        y = torch.bmm(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, hidden]
        return (y * routing.t().unsqueeze(-1)).sum(0).to(x.dtype)  # [T, hidden]

    def forward_sparse(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert on only its tokens (prefill-sized batches)."""
        out = torch.zeros_like(x)  # [T, hidden]
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[expert])  # [n, hidden]
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        return out


def _on_gpu(x: torch.Tensor) -> bool:
    """Where the grouped GEMM is a device kernel (on the CPU it is torch's loop over the groups)."""
    return x.device.type == "cuda"


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def _grouped_mm_device_kernel(device: torch.device) -> bool:
    """torch's grouped GEMM has a device kernel (no host loop) on SM90 and SM100 only."""
    return torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act,
                     reduce_results=False)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids, shared=self.shared_experts)
        return all_reduce(out)  # routed and shared experts' partial sums over the ranks, in one reduce
