"""Copies between host and device that never make the host wait for the GPU, in both directions.

Host -> device (`to_device`): a plain `torch.tensor(values, device="cuda")` (or `.to("cuda")`
of pageable memory) copies synchronously: the host stalls until every kernel already queued on the stream has run. With
overlap scheduling the stream always holds the previous step, so every per-step copy of host
metadata goes through pinned memory with `non_blocking=True`. The pinned block comes from
PyTorch's caching host allocator, which records the copy on the stream and does not hand the
block out again before the copy has run, so the host may build the next step's arrays at once.

Device -> host (`HostCopy`): a step's results (the sampled ids, and logprobs where asked) are
copied into pinned host memory with `non_blocking=True` behind the step's kernels, and a CUDA
event is recorded after the copy. The host reads them only through `wait()`, which blocks on
that event: with overlap scheduling that happens one step late, after the next step is queued.

Both live here, below the engine, because the attention backends and the KV pool copy host
metadata to the device too.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device`, without a host sync on CUDA.

    A numpy array keeps its dtype unless `dtype` is given; a list becomes `dtype`, int64 by default.
    """
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        if dtype is not None and host.dtype != dtype:
            host = host.to(dtype)
    else:
        host = torch.tensor(values, dtype=torch.int64 if dtype is None else dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host behind the work queued so far; `wait()` returns the copies."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"one device per copy, got {sorted(map(str, devices))}")
        self._event = None
        if next(iter(devices)).type == "cuda":
            self._host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in tensors.items()}
            for k, t in tensors.items():
                self._host[k].copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # host memory already, computed synchronously: nothing to wait for
            self._host = {k: t.detach() for k, t in tensors.items()}

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
