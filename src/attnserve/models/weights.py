"""Copying named checkpoint tensors into a model, fused projections included.

Checkpoints keep q/k/v and gate/up as separate tensors; the models fuse them.
A checkpoint may hand lazy tensors (read only in the slice a tensor-parallel
rank takes, see distributed.shard); modules that do not slice get them whole.
`stacked` maps a checkpoint name fragment to (fused fragment, part index) so each
tensor lands in its slice. Every parameter must be filled exactly once: a missing
or unexpected tensor is an error naming it, never a silently random weight.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from attnserve.distributed.shard import read_all

LLAMA_STACKED = [
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]

# checkpoint tensors that carry no weights of ours (precomputed RoPE tables and the like)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _owner_loader(model: nn.Module, param_name: str):
    module_name = param_name.rsplit(".", 1)[0]
    module = model.get_submodule(module_name) if module_name else model
    return getattr(module, "weight_loader", None)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: list[tuple[str, str, int]],
    source: str,
    rename=None,
) -> None:
    """Fill every parameter of `model` from `weights`.

    `rename(name)` returns the parameter name, None to drop the tensor, or (name, part) to pick
    the part of a fused parameter itself (part -1: the whole fused tensor).
    """
    params = dict(model.named_parameters())
    parts_needed: dict[str, set[int]] = {}
    for name, mod in model.named_modules():
        sizes = getattr(mod, "output_sizes", None)
        if sizes is not None and len(sizes) > 1:
            parts_needed[f"{name}.weight"] = set(range(len(sizes)))
            if getattr(mod, "bias", None) is not None:
                parts_needed[f"{name}.bias"] = set(range(len(sizes)))
        for pname, count in getattr(mod, "weight_parts", {}).items():  # e.g. one part per expert
            parts_needed[f"{name}.{pname}"] = set(range(count))
    parts_loaded: dict[str, set[int]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(_IGNORED_SUFFIXES):
            continue
        name = rename(ckpt_name) if rename is not None else ckpt_name
        if name is None:
            continue
        shard_id = 0
        if isinstance(name, tuple):  # rename already chose the fused parameter and part
            name, shard_id = name
        else:
            for frag, fused, idx in stacked:
                if frag in name and name.replace(frag, fused) in params:
                    name, shard_id = name.replace(frag, fused), idx
                    break
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = _owner_loader(model, name)
        if not getattr(getattr(loader, "__self__", None), "reads_slices", False):
            tensor = read_all(tensor)  # a lazy checkpoint tensor, read whole for a module that takes it whole
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor, shard_id, ckpt_name)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{source}: weight {ckpt_name} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor.to(param.dtype))
        if name in parts_needed:
            # shard_id -1: the checkpoint held the fused tensor whole
            parts_loaded.setdefault(name, set()).update(parts_needed[name] if shard_id == -1 else {shard_id})
        loaded.add(name)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
        raise ValueError(f"{source}: tensors the model has no place for: {shown}")
    missing = [n for n in params if n not in loaded or parts_loaded.get(n, set()) != parts_needed.get(n, set())]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"{source}: checkpoint is missing weights for: {shown}")
