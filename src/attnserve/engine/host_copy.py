"""A step's results on their way to the host: the one device-to-host transfer per step.

The sampled ids (and logprobs where asked) are copied into pinned host memory with
`non_blocking=True` behind the step's kernels, and a CUDA event is recorded after the
copy. The host reads them only through `wait()`, which blocks on that event: with
overlap scheduling that happens one step late, after the next step is already queued.
"""

from __future__ import annotations

import torch


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

    def ready(self) -> bool:
        """True once `wait()` would return at once."""
        return self._event is None or self._event.query()

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
