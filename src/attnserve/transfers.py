"""Host -> device copies that never make the host wait for the GPU.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of pageable memory) copies
synchronously: the host stalls until every kernel already queued on the stream has run. With
overlap scheduling the stream always holds the previous step, so every per-step copy of host
metadata goes through pinned memory with `non_blocking=True`. The pinned block comes from
PyTorch's caching host allocator, which records the copy on the stream and does not hand the
block out again before the copy has run, so the host may build the next step's arrays at once.
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
