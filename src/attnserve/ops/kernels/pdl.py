"""Programmatic dependent launch (PDL) for the fused ops: a kernel may start while the one before it ends.

A decode step at batch 1 is hundreds of kernels of a few microseconds; between two of them the GPU drains the
first grid and only then launches the next. With PDL (SM90 and later) the next grid is launched early, its
programs wait (griddepcontrol.wait) until the previous grid has finished and its writes are visible, and only
the launch and the programs' start overlap. Every kernel launched this way waits before any load or store,
so it reads nothing early and overwrites nothing still being read, and since each waits for its predecessor,
that one for its own, a kernel also sees every earlier kernel's writes. Each releases its dependents right
after its wait: they launch as soon as all its programs have started.

`benchmarks/pdl_chain_gpu.py` measured it on an H100 (`benchmarks/results/pdl_chain-h100.json`): 300 dependent
one-program kernels in a CUDA graph, 1.19 us a kernel plain, 0.73 with PDL. In the engine's decode step it
gains nothing (0.998-1.003x on an H200, `engine_gpu_decode.json`, `triton-graphs-pdl`: the cuBLAS GEMMs and
attention kernels between the fused ones do not take part), so `--enable-pdl` is off by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attnserve.attention.kernels.common import interpreting


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """First thing in a kernel: under PDL, wait for the previous grid, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_applies(device: torch.device) -> bool:
    """PDL needs an SM90 or later GPU (griddepcontrol), and the interpreter knows nothing of it."""
    return (device.type == "cuda" and not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(pdl: bool) -> dict:
    """The kernel's PDL constexpr and, when on, the launch attribute (Triton's `launch_pdl`)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
