"""A tripwire for host reads of tensor data: the CPU stand-in for "this code never syncs with the GPU".

On a GPU, reading a tensor's values on the host (.item(), .tolist(), bool(t), int(t), .cpu(), ...)
waits for every kernel queued before it. Inside `no_host_reads()` each of those raises, except
within `allowed()` (for code outside what is being checked, e.g. the model's own forward).
"""

from __future__ import annotations

import contextlib

import torch

_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
_state = {"depth": 0, "allowed": 0}


def _guard(name, real):
    def guarded(self, *args, **kwargs):
        if _state["depth"] and not _state["allowed"]:
            raise AssertionError(f"host read of tensor data: Tensor.{name}")
        return real(self, *args, **kwargs)

    return guarded


@contextlib.contextmanager
def no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    for name, real in saved.items():
        setattr(torch.Tensor, name, _guard(name, real))
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


@contextlib.contextmanager
def allowed():
    _state["allowed"] += 1
    try:
        yield
    finally:
        _state["allowed"] -= 1


def allowing(fn):
    """`fn` with host reads allowed (code that is not under test)."""

    def wrapper(*args, **kwargs):
        with allowed():
            return fn(*args, **kwargs)

    return wrapper
