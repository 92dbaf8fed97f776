"""Keep Python's cyclic garbage collector out of CUDA graph captures.

Why: a dead engine (or any object in a reference cycle) that owns CUDA graphs or
graph-pool memory is freed only when the cyclic collector runs. If that happens
while another graph is being captured, destroying the old graph is an operation
CUDA forbids during capture, and the new capture is invalidated ("operation not
permitted when stream is capturing"). Since torch 2.11 `torch.cuda.graph` no longer
collects before a capture, so building a second engine in one process could fail
at random. SGLang and vLLM guard their captures the same way: collect once before,
pause the collector during.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused_for_capture() -> Iterator[None]:
    """Collect garbage now, then keep the collector off until the block ends (on error too)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
