"""The GPU a tile is chosen for (`GpuTarget`), and the shared-memory check made before a launch.

Hopper (sm90) gives a block 227 KiB of shared memory; other GPUs have less: an A100 (sm80) 163 KiB,
consumer Ampere and Ada (sm86, sm89) 99 KiB, so Hopper's three-stage 128 x 64 extend tiles would not
launch there. The kernels' tile tables are keyed by `GpuTarget.arch`; `check_shared_memory` estimates
what a kernel's pipelined tiles need and raises a clear error before Triton fails at launch.

Everything here is plain Python, so the choice and the check run (and are tested) without a GPU:
pass a `GpuTarget` built from a capability and a shared-memory budget.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# opt-in shared memory per block (bytes), by compute capability, for GPUs whose properties are not at hand
SMEM_PER_BLOCK = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
                  (9, 0): 227 * 1024, (10, 0): 227 * 1024, (12, 0): 99 * 1024}
DEFAULT_SMEM = 99 * 1024  # the smallest budget of the GPUs above


@dataclass(frozen=True)
class GpuTarget:
    """What tile choice depends on: the architecture and the shared memory one block may use."""

    capability: tuple[int, int]
    smem_bytes: int

    @property
    def arch(self) -> str:
        """The table key: sm80, sm86, sm89, sm90, or default for any other architecture."""
        key = f"sm{self.capability[0]}{self.capability[1]}"
        return key if key in ARCHITECTURES else "default"

    @classmethod
    def of(cls, capability: tuple[int, int], smem_bytes: int | None = None) -> GpuTarget:
        cap = (int(capability[0]), int(capability[1]))
        return cls(cap, int(smem_bytes if smem_bytes is not None else SMEM_PER_BLOCK.get(cap, DEFAULT_SMEM)))

    @classmethod
    def of_device(cls, device: torch.device | str) -> GpuTarget | None:
        """The target of a CUDA device; None elsewhere (the interpreter takes small tiles of its own)."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", None)
        return cls.of((props.major, props.minor), smem or None)


ARCHITECTURES = ("sm80", "sm86", "sm89", "sm90")


@functools.cache
def _cuda_target(index: int) -> GpuTarget:
    return GpuTarget.of_device(torch.device("cuda", index))


def target_for(device: torch.device) -> GpuTarget | None:
    """GpuTarget.of_device, read once per device (launch paths call this every step)."""
    if device.type != "cuda":
        return None
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class TileShape:
    """One launch's tiles as the smem estimate sees them (elements, not bytes)."""

    rows: int  # query rows resident for the whole program (BLOCK_M, or BLOCK_H heads)
    cols_q: int  # their width (padded head_dim)
    block_n: int  # keys per pipelined tile
    cols_kv: int  # K + V (or the shared latent) columns read per key
    stages: int
    itemsize: int  # bytes per element of q / KV as loaded


def shared_memory_bytes(t: TileShape) -> int:
    """Estimate: the resident query tile plus `stages` buffered key/value tiles.

    Triton keeps pipelined loads in shared memory; the float32 accumulators live in registers.
    (Hopper's default tiles measure 128-196 KiB by this rule, under its 227 KiB.)
    """
    return t.itemsize * (t.rows * t.cols_q + max(1, t.stages) * t.block_n * t.cols_kv)


def fits(tiles: TileShape, target: GpuTarget | None) -> bool:
    return target is None or shared_memory_bytes(tiles) <= target.smem_bytes


def fewest_stages_dropped(config, shape_of, target: GpuTarget | None):
    """A default config with pipeline stages dropped until its tiles fit (e.g. float32 inputs double them).

    `shape_of(config)` gives the config's TileShape; block sizes stay, so host-side tile lists stay valid.
    """
    while config.num_stages > 1 and not fits(shape_of(config), target):
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def check_shared_memory(kernel: str, tiles: TileShape, target: GpuTarget | None) -> None:
    """Raise before launch when the tiles cannot fit this GPU's shared memory."""
    if target is None:
        return
    need = shared_memory_bytes(tiles)
    if need > target.smem_bytes:
        raise ValueError(
            f"{kernel}: tiles of {tiles.rows} query rows x {tiles.block_n} keys with {tiles.stages} stages need about "
            f"{need // 1024} KiB of shared memory, but this GPU (sm{target.capability[0]}{target.capability[1]}) "
            f"allows {target.smem_bytes // 1024} KiB per block; choose smaller block sizes or fewer stages"
        )


def settle_config(kernel: str, config, default, shape_of, target: GpuTarget | None):
    """The tiles a launch runs: `config` as given, or `default` with stages dropped until it fits (a given config
    is the caller's to keep); either way checked against the GPU's shared memory before Triton launches it."""
    if config is None:
        config = fewest_stages_dropped(default, shape_of, target)
    check_shared_memory(kernel, shape_of(config), target)
    return config
