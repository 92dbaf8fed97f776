"""Backend registry: every name SGLang knows, what each can do, and a lazy factory for ours.

Backends implemented here are listed as "module:Class"; their features are read from
the class (backend modules import heavy packages only inside methods, so reading
features is cheap). SGLang backends attnserve does not implement keep their
features here as data, so selection and validation can still reason about them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from attnserve.attention.base import ALL_KV_DTYPES, AttentionBackend, BackendFeatures
from attnserve.hardware import Hardware

_MHA = frozenset({"MHA", "GQA"})
_MLA = frozenset({"MLA"})
_ANY = frozenset({"MHA", "GQA", "MLA"})
_FP8 = frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"})
_NOFP8 = frozenset({"bf16", "fp16"})


@dataclass(frozen=True)
class BackendSpec:
    name: str
    summary: str
    factory: str | None = None  # "module:Class" when attnserve implements it
    data_features: BackendFeatures | None = None  # for backends without an implementation here
    removed: str | None = None  # SGLang removed it; why / when

    @property
    def implemented(self) -> bool:
        return self.factory is not None

    def load_class(self) -> type[AttentionBackend]:
        if self.factory is None:
            raise ValueError(f"attention backend {self.name!r} is known (SGLang) but not implemented in attnserve")
        module, cls = self.factory.split(":")
        return getattr(importlib.import_module(module), cls)

    @property
    def features(self) -> BackendFeatures:
        if self.factory is not None:
            return self.load_class().features
        assert self.data_features is not None
        return self.data_features


def _f(**kw) -> BackendFeatures:
    return BackendFeatures(implemented=False, **kw)


_PKG = "attnserve.attention.backends"
_SPECS = [
    BackendSpec("torch_native", "PyTorch reference over the paged pool; CPU default", f"{_PKG}.torch_native:TorchNativeBackend"),
    BackendSpec("triton", "attnserve's Triton kernels: split-KV decode, paged-prefix extend", f"{_PKG}.triton:TritonBackend"),
    BackendSpec("flashinfer", "FlashInfer paged decode/prefill; SGLang's general NVIDIA default", f"{_PKG}.flashinfer:FlashInferBackend"),
    BackendSpec("flex_attention", "PyTorch FlexAttention with a block mask from the page table", f"{_PKG}.flex:FlexAttentionBackend"),
    BackendSpec("fa3", "FlashAttention 3 (SGLang sgl-kernel); the Hopper default", data_features=_f(
        kv_dtypes=frozenset({"bf16", "fp16", "fp8_e4m3"}), attention_types=_ANY, sliding_window=True,
        attention_sinks=True, logit_softcap=True, custom_mask=True, spec_topk1=True, spec_topk_gt1=True,
        spec_topk_gt1_paged=True, cuda_graph=True, deterministic=True, compute_capabilities=(8, 9),
        required_packages=("sgl_kernel",))),
    BackendSpec("fa4", "FlashAttention 4 (Blackwell); prefill only, native page 128", data_features=_f(
        page_sizes=(128,), kv_dtypes=_NOFP8, attention_types=_MHA, asymmetric_kv=True, decode=False,
        cuda_graph=True, compute_capabilities=(10,), required_packages=("flash_attn",))),
    BackendSpec("trtllm_mha", "TensorRT-LLM MHA kernels via FlashInfer (SM100/SM103, SM90 with limits)", data_features=_f(
        page_sizes=(16, 32, 64, 128), kv_dtypes=_FP8, attention_types=_MHA, sliding_window=True,
        attention_sinks=True, spec_topk1=True, cuda_graph=True, compute_capabilities=(9, 10),
        required_packages=("flashinfer",))),
    BackendSpec("trtllm_mla", "TensorRT-LLM MLA kernels via FlashInfer (SM100)", data_features=_f(
        page_sizes=(32, 64), kv_dtypes=_FP8, attention_types=_MLA, spec_topk1=True, cuda_graph=True,
        compute_capabilities=(10,), required_packages=("flashinfer",))),
    BackendSpec("flashmla", "DeepSeek FlashMLA decode, page 64", data_features=_f(
        page_sizes=(64,), kv_dtypes=frozenset({"bf16", "fp8_e4m3"}), attention_types=_MLA, spec_topk1=True,
        cuda_graph=True, compute_capabilities=(9, 10), required_packages=("sgl_kernel",))),
    BackendSpec("cutedsl_mla", "CuTe-DSL MLA decode (Blackwell)", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MLA, cuda_graph=True, compute_capabilities=(10,),
        required_packages=("sgl_kernel",))),
    BackendSpec("tokenspeed_mla", "TokenSpeed MLA decode kernels", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MLA, cuda_graph=True, compute_capabilities=(9, 10),
        required_packages=("sgl_kernel",))),
    BackendSpec("cutlass_mla", "CUTLASS MLA decode, page 128", data_features=_f(
        page_sizes=(128,), kv_dtypes=_FP8, attention_types=_MLA, cuda_graph=True, compute_capabilities=(10,),
        required_packages=("sgl_kernel",)), removed="deleted from SGLang in PR 32114 (2026-09-10)"),
    BackendSpec("dual_chunk_flash_attn", "dual-chunk attention for Qwen long context", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, compute_capabilities=(8, 9), required_packages=("sgl_kernel",)),
        removed="deleted from SGLang in PR 32114 (2026-09-10)"),
    BackendSpec("dsa", "DeepSeek sparse attention (V3.2), one model family", data_features=_f(
        kv_dtypes=frozenset({"bf16", "fp8_e4m3"}), attention_types=_MLA, cuda_graph=True,
        compute_capabilities=(9, 10), required_packages=("sgl_kernel",))),
    BackendSpec("dsv4", "DeepSeek V4 compressed attention, one model family", data_features=_f(
        kv_dtypes=frozenset({"bf16", "fp8_e4m3"}), attention_types=_MLA, cuda_graph=True,
        compute_capabilities=(9, 10), required_packages=("sgl_kernel",))),
    BackendSpec("qsa", "sparse attention for one model family", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, cuda_graph=True, compute_capabilities=(9, 10),
        required_packages=("sgl_kernel",))),
    BackendSpec("minicpm_flashattn", "MiniCPM sparse attention on FlashAttention", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, cuda_graph=True, compute_capabilities=(8, 9),
        required_packages=("sgl_kernel",))),
    BackendSpec("minicpm_flashinfer", "MiniCPM sparse attention on FlashInfer", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, cuda_graph=True, required_packages=("flashinfer",))),
    BackendSpec("aiter", "AMD AITER kernels; the ROCm default for MHA", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_ANY, spec_topk1=True, spec_topk_gt1=True, spec_topk_gt1_paged=True,
        cuda_graph=True, devices=frozenset({"rocm"}), required_packages=("aiter",))),
    BackendSpec("wave", "AMD Wave kernels", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, cuda_graph=True, devices=frozenset({"rocm"}),
        required_packages=("wave_lang",))),
    BackendSpec("intel_amx", "x86 CPUs with AMX (sgl-kernel CPU ops)", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_ANY, devices=frozenset({"cpu"}), required_packages=("sgl_kernel",))),
    BackendSpec("intel_xpu", "Intel GPUs", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_ANY, devices=frozenset({"xpu"}), required_packages=("sgl_kernel",))),
    BackendSpec("ascend", "Huawei Ascend NPUs", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_ANY, devices=frozenset({"npu"}), required_packages=("torch_npu",))),
    BackendSpec("hpc_ops", "Tencent SM90 kernels, page 64", data_features=_f(
        page_sizes=(64,), kv_dtypes=_NOFP8, attention_types=_MHA, cuda_graph=True, compute_capabilities=(9,),
        required_packages=("hpc_ops",))),
    BackendSpec("llada2_cfg_flashinfer", "FlashInfer variant for the LLaDA2 diffusion language model", data_features=_f(
        kv_dtypes=_NOFP8, attention_types=_MHA, required_packages=("flashinfer",))),
]

REGISTRY: dict[str, BackendSpec] = {s.name: s for s in _SPECS}
ALIASES: dict[str, str] = {"nsa": "dsa", "compressed": "dsv4"}


def resolve_name(name: str) -> str:
    """Canonical backend name; an unknown one raises listing the valid names."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in REGISTRY:
        valid = sorted(REGISTRY) + sorted(f"{a} (= {t})" for a, t in ALIASES.items())
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(valid)}")
    return key


def get_spec(name: str) -> BackendSpec:
    return REGISTRY[resolve_name(name)]


def cc_name(major: int) -> str:
    return {8: "SM80/SM89 (Ampere/Ada)", 9: "SM90 (Hopper)", 10: "SM100 (Blackwell)", 12: "SM120"}.get(major, f"SM{major}x")


def hardware_problems(features: BackendFeatures, hw: Hardware) -> list[str]:
    """Why a backend with these features can't run on `hw` (device, compute capability, packages)."""
    why = []
    if hw.device not in features.devices:
        need = "/".join(sorted(d.upper() if d != "rocm" else "ROCm" for d in features.devices))
        why.append(f"needs {need} (this is {hw.device})")
    elif hw.device == "cuda" and hw.compute_capability is not None:
        major = hw.compute_capability[0]
        if features.compute_capabilities is not None and major not in features.compute_capabilities:
            need = " or ".join(cc_name(m) for m in features.compute_capabilities)
            why.append(f"needs {need}, this GPU is sm{hw.sm}")
        if features.min_compute_capability is not None and hw.compute_capability < features.min_compute_capability:
            mj, mn = features.min_compute_capability
            why.append(f"needs compute capability >= {mj}.{mn}, this GPU is sm{hw.sm}")
    for pkg in features.required_packages:
        if not hw.has_package(pkg):
            why.append(f"package '{pkg}' is not installed")
    return why


def availability(name: str, hw: Hardware) -> list[str]:
    """Every reason backend `name` cannot run on `hw`; empty when it can."""
    spec = get_spec(name)
    why = []
    if spec.removed:
        why.append(f"removed from SGLang ({spec.removed})")
    if not spec.implemented:
        why.append("not implemented in attnserve (known from SGLang)")
    why += hardware_problems(spec.features, hw)
    return why


def create_backend(name: str, pool, hw: Hardware | None = None, **options) -> AttentionBackend:
    """Instantiate a backend, or raise ValueError with every reason it can't run here."""
    from attnserve.hardware import detect_hardware

    spec = get_spec(name)
    problems = availability(spec.name, hw or detect_hardware())
    if problems:
        raise ValueError(f"attention backend {spec.name!r} cannot run here: {'; '.join(problems)}")
    return spec.load_class()(pool, **options)


__all__ = ["ALIASES", "ALL_KV_DTYPES", "REGISTRY", "BackendSpec", "availability", "create_backend", "get_spec",
           "hardware_problems", "resolve_name"]
