"""How a CPU model holds its projection weights: the format chosen once at load, the matmul per step by rows.

Formats (`--weights-dtype`):
- dequantized: dense weights in the model dtype (every GGUF block decoded to floats). bf16 weights are
  reordered once into oneDNN's blocked layout, so no step pays that reorder again.
- int4: the GGUF's Q4_0/Q4_1 blocks kept 4-bit, repacked once for torch's CPU int4 weight-only matmul
  (`_weight_int4pack_mm_for_cpu`, group size 32 = one GGUF block, scale and zero per group); the
  dense weights are dropped. Every step runs the int4 kernel, whose cost grows with the rows almost
  linearly (it is a GEMV per row), so prefill is slow: the smallest memory, not the fastest.
- auto (the default): on a CPU model in bf16 loaded from a GGUF with Q4 weights, both: the int4
  kernel for steps of at most `INT4_MAX_ROWS` rows (one or two decoding requests: it reads 4x fewer
  bytes than bf16) and the prepacked bf16 GEMM above that (AMX tiles win once there are rows to fill
  them). Anything else: dequantized.

Deterministic inference (`make_batch_invariant`): a projection holding both formats runs one of them at every
row count, and every kernel call gets the same number of rows (`DETERMINISTIC_ROW_BLOCK`, the last block
padded with zero rows). The kernels choose their code path by the row count: oneDNN's bf16 matmul on an
AMX CPU runs another kernel above 32 rows, and MKL's fp32 GEMM another for a single row and again for
larger blocks, each rounding a row differently, so a row's result depended on how many rows shared its
step. At one fixed shape the kernel is the same in every call; a check at start-up makes sure a row's
result does not depend on its place in the block or on the rows beside it, and a kernel that fails it
runs one row a call.

The int4 kernel takes bf16 activations (fp32 ones run a much slower scalar path), so an fp32 model
casts around it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.linear import ColumnParallelLinear, RowParallelLinear
from attnserve.distributed.state import parallel_state
from attnserve.models.gguf_loader import GGUFFile, unpermute_rows
from attnserve.models.q4_blocks import GROUP, Q4Codes, is_q4, read_q4
from attnserve.models.weights import LLAMA_STACKED

log = logging.getLogger("attnserve.models")

WEIGHT_FORMATS = ("auto", "dequantized", "int4")
INT4_MAX_ROWS = 2  # auto: int4 up to this many rows per matmul, prepacked bf16 above


class CPUMatmul:
    """y = x W^T (+ bias) for one linear, with W in the formats the model was packed to.

    int4: (packed [N, K/2] uint8, scales_and_zeros [K/32, N, 2] bf16), used for <= int4_max_rows rows;
    dense: W prepacked by oneDNN (bf16) or plain, used for more rows (or always, without int4).
    `row_block` (deterministic inference): every kernel call gets exactly this many rows (0: as many as come).
    """

    def __init__(self, dense: torch.Tensor | None, int4: tuple[torch.Tensor, torch.Tensor] | None,
                 int4_max_rows: int, out_dtype: torch.dtype, row_block: int = 0):
        self.dense = dense
        self.int4 = int4
        self.int4_max_rows = int4_max_rows if dense is not None else 1 << 62
        self.out_dtype = out_dtype
        self.dense_packed = dense is not None and dense.is_mkldnn
        self.row_block = row_block

    @property
    def kernel(self) -> str:
        """The kernel a deterministic step runs (what the start-up log and the invariance check name)."""
        if self.int4 is not None and (self.dense is None or self.int4_max_rows > 0):
            return "int4"
        if self.dense_packed:
            return "oneDNN bf16"
        return f"BLAS {str(self.dense.dtype).replace('torch.', '')}"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        block, rows = self.row_block, x.shape[0]
        if not block or rows in (0, block):
            return self._kernel(x, bias)
        pad = -rows % block
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])  # [rows + pad, K]
        blocks = [self._kernel(x[i : i + block], bias) for i in range(0, rows + pad, block)]
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:rows]  # [rows, N]

    def _kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.int4_max_rows:
            packed, scales_zeros = self.int4
            if x.dtype != torch.bfloat16:
                x = x.to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
            if y.dtype != self.out_dtype:
                y = y.to(self.out_dtype)
            return y if bias is None else y + bias
        if self.dense_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.dense, bias, "none", [], "")
        return F.linear(x, self.dense, bias)


# deterministic inference: rows per kernel call. Dense kernels cost about the same for 1 and 16 rows (they
# read the weights once); the int4 kernel's cost grows with the rows, so its block is small
DETERMINISTIC_ROW_BLOCK = 16
DETERMINISTIC_INT4_ROW_BLOCK = 4


def make_batch_invariant(model: nn.Module) -> str:
    """Deterministic inference on the CPU: a row's projections round the same whatever the rows beside it.

    Every projection and the LM head get a `CPUMatmul` that runs one format (the dense one where both are
    held) in calls of a fixed row count, and each kernel and shape is checked once (`rows_are_independent`):
    where a row's result changes with its place in the call, that shape runs one row a call. Returns the
    start-up log's note. Tensor-parallel ranks and other devices are left as they are (`batch_variant_parts`
    says so)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params or params[0].device.type != "cpu" or parallel_state().active:
        return ""
    modules = [m for _, m in _linears(model)]
    head = getattr(model, "lm_head", None)
    if head is not None:
        modules.append(head)
    per_row: dict[str, int] = {}
    blocks: dict[str, int] = {}
    checked: dict[tuple, bool] = {}  # (kernel, out, in) -> rows independent: a kernel's path is its shape's
    for module in modules:
        mm = module.cpu_matmul
        if mm is None:
            module.cpu_matmul = mm = CPUMatmul(module.weight.data, None, 0, module.weight.dtype)
        if mm.int4 is not None and mm.dense is not None:
            mm.int4_max_rows = 0
        mm.row_block = DETERMINISTIC_INT4_ROW_BLOCK if mm.kernel == "int4" else DETERMINISTIC_ROW_BLOCK
        in_features = getattr(module, "in_features", None) or module.weight.shape[1]
        shape = (mm.kernel, getattr(module, "out_features", None) or module.weight.shape[0], in_features)
        if shape not in checked:
            checked[shape] = rows_are_independent(mm, in_features, params[0].dtype)
        if not checked[shape]:
            mm.row_block = 1
            per_row[mm.kernel] = per_row.get(mm.kernel, 0) + 1
        else:
            blocks[mm.kernel] = mm.row_block
    for kernel, n in per_row.items():
        log.warning("deterministic inference: the %s kernel's rows depend on their place in a call on this CPU "
                    "(%d projections); they run one row a call (slower prefill)", kernel, n)
    parts = [f"{k} in {b}-row calls" for k, b in blocks.items()] + [f"{k} one row a call" for k in per_row]
    return "batch-invariant matmuls: " + ", ".join(parts)


def batch_variant_parts(model: nn.Module) -> list[str]:
    """What deterministic inference leaves depending on the batch in `model` where it runs (empty: nothing, so
    a request's logits are bitwise the same whatever shares its step)."""
    from attnserve.models.deepseek import MLAttention
    from attnserve.models.moe import Experts, Router

    params = [p for p in model.parameters() if p.is_floating_point()]
    device = params[0].device.type if params else "cpu"
    if device != "cpu":
        return [f"on {device} the matmul libraries choose their kernels by the row count"]
    if parallel_state().active:
        return ["tensor-parallel ranks run plain matmuls and sum partial results across ranks"]
    gaps = []
    if any(isinstance(m, (Router, Experts)) for m in model.modules()):
        gaps.append("the MoE router and experts multiply the tokens each expert gets, a count set by the batch")
    if any(isinstance(m, MLAttention) for m in model.modules()):
        gaps.append("MLA's up-projections are batched matmuls over the step's tokens")
    return gaps


def rows_are_independent(mm: CPUMatmul, in_features: int, dtype: torch.dtype, seed: int = 0) -> bool:
    """Whether `mm`'s result for a row is the same bits wherever the row sits among its call's rows and
    whatever rows sit beside it (two blocks of random rows, then the same rows moved by a few places and
    fewer of them). Raises if the same call twice gives different bits: nothing could be promised then."""
    g = torch.Generator().manual_seed(seed)
    block = max(mm.row_block, 1)
    x = torch.randn(2 * block, in_features, generator=g).to(dtype)  # [2B, K]
    with torch.no_grad():
        y = mm(x)
        if not torch.equal(y, mm(x)):
            raise RuntimeError(f"deterministic inference: the {mm.kernel} kernel gives different results for the "
                               "same input on this CPU; run without --enable-deterministic-inference")
        shift = min(3, 2 * block - 1)
        moved = mm(torch.roll(x, shift, dims=0))  # every row at another place, beside other rows
        few = mm(x[: max(block // 2, 1) + 1])  # a partial block (padded)
    return torch.equal(torch.roll(y, shift, dims=0), moved) and torch.equal(y[: few.shape[0]], few)


def onednn_has_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_dense(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> oneDNN's blocked layout (an opaque mkldnn tensor); other dtypes stay as they are, and so
    does bf16 where oneDNN has no bf16 path (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU asked
    for bf16 runs plain F.linear)."""
    if w.dtype != torch.bfloat16 or not onednn_has_bf16():
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def pack_int4(codes: Q4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4 codes [N, K] -> what `_weight_int4pack_mm_for_cpu` takes: packed [N, K/2] uint8, [K/32, N, 2] bf16."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack([codes.scale.t(), codes.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def _q4_parts(model: nn.Module, source: str, hf_config: dict) -> dict[str, dict[int, Q4Codes]]:
    """module name -> {part index: its rows' Q4 codes} for every 4-bit GGUF tensor of the model's projections."""
    gf = GGUFFile(source)
    modules = dict(model.named_modules())
    parts: dict[str, dict[int, Q4Codes]] = {}
    for hf_name, lazy in gf.tensors(hf_config, torch.float32):
        t = lazy.t
        if not hf_name.endswith(".weight") or not is_q4(t.type_name) or len(t.shape) != 2:
            continue
        name, part = hf_name.removeprefix("model.").removesuffix(".weight"), 0
        for frag, fused, idx in LLAMA_STACKED:
            frag, fused = frag.strip("."), fused.strip(".")
            if name.endswith(frag) and name.removesuffix(frag) + fused in modules:
                name, part = name.removesuffix(frag) + fused, idx
                break
        if name not in modules:
            continue
        codes = read_q4(t.data, t.type_name, t.shape)
        if lazy.row_heads:  # llama.cpp's per-head row order, undone as the dense load undoes it
            order = unpermute_rows(torch.arange(t.shape[0]), lazy.row_heads)
            codes = codes.take_rows(order)
        parts.setdefault(name, {})[part] = codes
    return parts


def _whole(module: nn.Module, found: dict[int, Q4Codes]) -> Q4Codes | None:
    """The module's full weight as codes, when every part of it was 4-bit (else None: it stays dense)."""
    sizes = getattr(module, "output_sizes", [module.weight.shape[0]])
    if sorted(found) != list(range(len(sizes))):
        return None
    ordered = [found[i] for i in range(len(sizes))]
    if [c.codes.shape[0] for c in ordered] != list(sizes):
        return None
    return Q4Codes(torch.cat([c.codes for c in ordered]), torch.cat([c.scale for c in ordered]),
                   torch.cat([c.zero for c in ordered]))


def _linears(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            yield name, module


def pack_cpu_weights(model: nn.Module, bundle, weights_dtype: str = "auto") -> str:
    """Give every projection of a CPU model its `CPUMatmul`; returns the start-up log's description.

    Runs once, after loading and before the first step. Tensor-parallel ranks and other devices keep
    plain dense linears.
    """
    if weights_dtype not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights dtype {weights_dtype!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params or params[0].device.type != "cpu" or parallel_state().active:
        if weights_dtype == "int4":
            raise ValueError("--weights-dtype int4 runs on the CPU with one tensor-parallel rank only")
        return "dequantized"
    dtype = params[0].dtype
    is_q4_gguf = getattr(bundle, "format", None) == "gguf" and any(
        is_q4(t.type_name) for t in _gguf_tensors(bundle.source))
    fmt = weights_dtype
    if fmt == "auto":
        fmt = "int4+dense" if is_q4_gguf and dtype == torch.bfloat16 else "dequantized"
    if fmt == "int4" and not is_q4_gguf:
        source = getattr(bundle, "source", None) or "this model"
        raise ValueError(f"--weights-dtype int4 needs a GGUF file with Q4_0/Q4_1 weights; {source} has none")
    q4 = _q4_parts(model, bundle.source, bundle.hf_config) if fmt != "dequantized" else {}
    kept_4bit = 0
    for name, module in _linears(model):
        codes = _whole(module, q4[name]) if name in q4 else None
        int4 = pack_int4(codes) if codes is not None else None
        dense = None if (fmt == "int4" and int4 is not None) else prepack_dense(module.weight.data)
        if int4 is None and dense is not None and not dense.is_mkldnn:
            continue  # a plain dense linear: F.linear as before
        module.cpu_matmul = CPUMatmul(dense, int4, INT4_MAX_ROWS, dtype)
        if int4 is not None:
            kept_4bit += 1
            if dense is None:  # int4 only: the dense copy goes (4x less weight memory)
                module.weight.data = torch.empty(0, dtype=dtype)
    head = getattr(model, "lm_head", None)
    if head is not None and dtype == torch.bfloat16 and onednn_has_bf16():
        head.cpu_matmul = CPUMatmul(prepack_dense(head.weight.data), None, 0, dtype)
    packed_note = ", bf16 prepacked for oneDNN" if dtype == torch.bfloat16 and onednn_has_bf16() else ""
    if fmt == "dequantized":
        return f"dequantized ({str(dtype).replace('torch.', '')}{packed_note})"
    if fmt == "int4":
        return f"int4 ({kept_4bit} projections 4-bit only, group {GROUP}; the rest dense)"
    return (f"int4 + bf16 ({kept_4bit} projections: int4 for <= {INT4_MAX_ROWS} rows, "
            f"prepacked bf16 above)")


def _gguf_tensors(source: str):
    return GGUFFile(source).tensor_list
