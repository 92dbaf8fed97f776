"""A description of the machine a backend would run on: real (detected) or hypothetical (`--gpu h100`)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from attnserve._lazy import is_installed


@dataclass(frozen=True)
class Hardware:
    device: str = "cpu"  # cpu, cuda, rocm, mps, xpu, npu
    vendor: str = "none"  # nvidia, amd, apple, intel, huawei, none
    name: str = "cpu"
    compute_capability: tuple[int, int] | None = None  # NVIDIA only, e.g. (9, 0)
    cuda_version: tuple[int, int] | None = None
    num_sms: int | None = None
    memory_gb: float | None = None
    arch: str = "x86_64"  # host CPU architecture
    # packages importable on this machine; None = hypothetical machine where everything counts as installed
    installed: frozenset[str] | None = field(default=None)
    cpu_bf16: bool = False  # the host CPU multiplies bf16 in hardware (AMX or AVX512-BF16)

    def has_package(self, module: str) -> bool:
        if self.installed is None:
            return True
        return module in self.installed

    @property
    def sm(self) -> int | None:
        """Compute capability as one number (90 for Hopper, 100 for B200)."""
        if self.compute_capability is None:
            return None
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    def describe(self) -> str:
        parts = [self.name, self.device]
        if self.compute_capability:
            parts.append(f"sm{self.sm}")
        if self.cuda_version:
            parts.append(f"CUDA {self.cuda_version[0]}.{self.cuda_version[1]}")
        return ", ".join(parts)


# packages whose presence matters to some backend
KNOWN_PACKAGES = ("triton", "flashinfer", "sgl_kernel", "flash_attn", "flash_attn.cute", "flash_attn_interface", "aiter",
                  "flash_mla")  # flash_attn.cute: FA4 (flash-attn-4); a plain flash_attn is FA2

# hypothetical machines for `attnserve select --gpu NAME`
PRESET_HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("cuda", "nvidia", "NVIDIA H100", (9, 0), (12, 8), 132, 80),
    "h200": Hardware("cuda", "nvidia", "NVIDIA H200", (9, 0), (12, 8), 132, 141),
    "h20": Hardware("cuda", "nvidia", "NVIDIA H20", (9, 0), (12, 8), 78, 96),
    "b200": Hardware("cuda", "nvidia", "NVIDIA B200", (10, 0), (12, 8), 148, 180),
    "gb300": Hardware("cuda", "nvidia", "NVIDIA GB300", (10, 3), (12, 9), 160, 288),
    "rtx5090": Hardware("cuda", "nvidia", "NVIDIA RTX 5090", (12, 0), (12, 8), 170, 32),
    "a100": Hardware("cuda", "nvidia", "NVIDIA A100", (8, 0), (12, 4), 108, 80),
    "l4": Hardware("cuda", "nvidia", "NVIDIA L4", (8, 9), (12, 4), 58, 24),
    "mi300": Hardware("rocm", "amd", "AMD MI300X", None, None, 304, 192),
    "mi355": Hardware("rocm", "amd", "AMD MI355X", None, None, 256, 288),
    "cpu": Hardware("cpu", "none", "x86_64 CPU"),
    "cpu-amx": Hardware("cpu", "intel", "Intel Xeon (AMX)", cpu_bf16=True),
    "arm-cpu": Hardware("cpu", "none", "ARM64 CPU", arch="aarch64"),
    "mps": Hardware("mps", "apple", "Apple M-series GPU", arch="arm64"),
    "xpu": Hardware("xpu", "intel", "Intel Data Center GPU"),
    "npu": Hardware("npu", "huawei", "Huawei Ascend NPU"),
}


def cpu_has_hardware_bf16() -> bool:
    """AMX or AVX512-BF16 on this machine's CPU: bf16 matmuls run in hardware (elsewhere they are emulated,
    slower than fp32)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\nprocessor", 1)[0]
    except OSError:
        return False
    return bool({"amx_bf16", "avx512_bf16"} & set(first.split()))


def detect_hardware() -> Hardware:
    """This machine, with what is installed checked for real."""
    import platform

    import torch

    installed = frozenset(p for p in KNOWN_PACKAGES if is_installed(p)) | {"torch"}
    arch = platform.machine() or "unknown"
    bf16 = cpu_has_hardware_bf16()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if getattr(torch.version, "hip", None):
            return Hardware("rocm", "amd", props.name, None, None, props.multi_processor_count,
                            props.total_memory / 1e9, arch, installed, cpu_bf16=bf16)
        cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
        return Hardware("cuda", "nvidia", props.name, (props.major, props.minor), cuda,
                        props.multi_processor_count, props.total_memory / 1e9, arch, installed, cpu_bf16=bf16)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return Hardware("mps", "apple", "Apple MPS", arch=arch, installed=installed, cpu_bf16=bf16)
    return Hardware("cpu", "none", f"{arch} CPU", arch=arch, installed=installed, cpu_bf16=bf16)


def cpu_model_name() -> str | None:
    """The CPU's model name where /proc/cpuinfo gives it, else what `platform` knows (None if nothing)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
