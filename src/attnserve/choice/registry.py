"""Backend registry: every name SGLang knows, what each can do, and a lazy factory for ours.

Backends implemented here are listed with a loader: a function whose import of the
class is written out (so the import graph sees every backend), run only when the name is
used. Features are read from the class (backend modules import heavy packages only inside
methods, so reading features is cheap). Where a name has one class for MHA/GQA pools and another for MLA
latent pools, the spec names both: `load_class(pool)` picks the one that fits the pool,
and the name's features are what the two together support (`family_features`). SGLang
backends attnserve does not implement keep their features here as data, so selection
and validation can still reason about them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from attnserve.attention.base import ALL_KV_DTYPES, AttentionBackend, BackendFeatures
from attnserve.attention.hybrid import HybridAttentionBackend
from attnserve.hardware import Hardware, detect_hardware

Loader = Callable[[], "type[AttentionBackend]"]  # imports and returns a backend class
_MHA = frozenset({"MHA", "GQA"})
_MLA = frozenset({"MLA"})
_ANY = frozenset({"MHA", "GQA", "MLA"})
_FP8 = frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"})
_NOFP8 = frozenset({"bf16", "fp16"})


# ---- one name, two classes: what the name supports is what either class supports ----------------------
def _either(a: bool, b: bool) -> bool:
    return a or b


def _union(a, b):
    """Allowed values of either class; None allows anything."""
    if a is None or b is None:
        return None
    if isinstance(a, frozenset):
        return a | b
    return tuple(dict.fromkeys((*a, *b)))


def _weakest_minimum(a, b):
    return None if a is None or b is None else min(a, b)


COMBINE_FAMILY = {
    "page_sizes": _union, "kv_dtypes": _union, "attention_types": _union, "head_dims": _union,
    "devices": _union, "compute_capabilities": _union, "required_packages": _union,
    "min_compute_capability": _weakest_minimum,
    "implemented": lambda a, b: a and b,
}


def family_features(mha: BackendFeatures, mla: BackendFeatures) -> BackendFeatures:
    """The features of a name whose MHA/GQA pools and MLA pools are served by different classes."""
    values = {}
    for f in dataclasses.fields(BackendFeatures):
        combine = COMBINE_FAMILY.get(f.name)
        if combine is None and f.type not in ("bool", bool):
            raise TypeError(f"BackendFeatures.{f.name} has no rule for combining a name's two classes")
        values[f.name] = (combine or _either)(getattr(mha, f.name), getattr(mla, f.name))
    return BackendFeatures(**values)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    summary: str
    factory: Loader | None = None  # when attnserve implements it: the class for every pool, or for MHA/GQA
    data_features: BackendFeatures | None = None  # for backends without an implementation here
    removed: str | None = None  # SGLang removed it; why / when
    mla_factory: Loader | None = None  # the class for MLA latent pools, when another class serves them

    @property
    def implemented(self) -> bool:
        return self.factory is not None

    def load_class(self, pool) -> type[AttentionBackend]:
        """The class that serves `pool` (MLA latent pools take `mla_factory` where the name has one): the one
        place a backend name becomes its MHA or its MLA class."""
        if self.factory is None:
            raise ValueError(f"attention backend {self.name!r} is known (SGLang) but not implemented in attnserve")
        return (self.mla_factory if self.mla_factory is not None and pool.is_mla else self.factory)()

    def build(self, pool, **options) -> AttentionBackend:
        """The backend object over `pool`, of the class that fits it."""
        return self.load_class(pool)(pool, **options)

    @property
    def features(self) -> BackendFeatures:
        if self.factory is None:
            assert self.data_features is not None
            return self.data_features
        if self.mla_factory is None:
            return self.factory().features
        return family_features(self.factory().features, self.mla_factory().features)


# ---- the classes attnserve implements, each imported when its name is first used --------------------------
def _torch_native() -> type[AttentionBackend]:
    from attnserve.attention.backends.torch_native import TorchNativeBackend
    return TorchNativeBackend


def _triton_mha() -> type[AttentionBackend]:
    from attnserve.attention.backends.triton import TritonMHABackend
    return TritonMHABackend


def _triton_mla() -> type[AttentionBackend]:
    from attnserve.attention.backends.triton import TritonMLABackend
    return TritonMLABackend


def _flashinfer_mha() -> type[AttentionBackend]:
    from attnserve.attention.backends.flashinfer import FlashInferMHABackend
    return FlashInferMHABackend


def _flashinfer_mla() -> type[AttentionBackend]:
    from attnserve.attention.backends.flashinfer import FlashInferMLABackend
    return FlashInferMLABackend


def _flex() -> type[AttentionBackend]:
    from attnserve.attention.backends.flex import FlexAttentionBackend
    return FlexAttentionBackend


def _fa4() -> type[AttentionBackend]:
    from attnserve.attention.backends.fa4 import FA4Backend
    return FA4Backend


def _f(**kw) -> BackendFeatures:
    return BackendFeatures(implemented=False, **kw)


_SPECS = [
    BackendSpec("torch_native", "PyTorch reference over the paged pool; CPU default", _torch_native),
    BackendSpec("triton", "attnserve's Triton kernels: split-KV decode, paged-prefix extend", _triton_mha,
                mla_factory=_triton_mla),
    BackendSpec("flashinfer", "FlashInfer paged decode/prefill; SGLang's general NVIDIA default",
                _flashinfer_mha, mla_factory=_flashinfer_mla),
    BackendSpec("flex_attention", "PyTorch FlexAttention with a block mask from the page table", _flex),
    BackendSpec("fa3", "FlashAttention 3 (SGLang sgl-kernel); the Hopper default", data_features=_f(
        kv_dtypes=frozenset({"bf16", "fp16", "fp8_e4m3"}), attention_types=_ANY, sliding_window=True,
        attention_sinks=True, logit_softcap=True, custom_mask=True, spec_topk1=True, spec_topk_gt1=True,
        spec_topk_gt1_paged=True, cuda_graph=True, deterministic=True, compute_capabilities=(8, 9),
        required_packages=("sgl_kernel",))),
    BackendSpec("fa4", "FlashAttention 4 (flash-attn-4, CuTe DSL): prefill/extend on Hopper and Blackwell; "
                "decode on another backend", _fa4),
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
    """Instantiate the backend class of `name` that fits the pool, or raise ValueError with every reason
    it can't run here."""
    spec = get_spec(name)
    problems = availability(spec.name, hw or detect_hardware())
    if problems:
        raise ValueError(f"attention backend {spec.name!r} cannot run here: {'; '.join(problems)}")
    return spec.build(pool, **options)


def backend_for_pool(name: str, pool, **options) -> AttentionBackend:
    """The backend `name` over `pool`, of the class that fits it, without asking whether this machine can run it
    (kernel tests run the triton backend through Triton's interpreter on a CPU)."""
    return get_spec(name).build(pool, **options)


def build_backend(selection, pool, hw=None, speculative_attention_mode: str = "prefill", **options) -> AttentionBackend:
    """Instantiate what a Selection names: one backend, or a hybrid when prefill and decode differ (the choice
    composes the hybrid; the runtime only routes steps through it)."""
    if not selection.is_hybrid:
        return create_backend(selection.prefill_backend, pool, hw, **options)
    prefill = create_backend(selection.prefill_backend, pool, hw, **options)
    decode = create_backend(selection.decode_backend, pool, hw, **options)
    return HybridAttentionBackend(prefill, decode, speculative_attention_mode)


__all__ = ["ALIASES", "ALL_KV_DTYPES", "REGISTRY", "BackendSpec", "availability", "backend_for_pool", "build_backend",
           "create_backend",
           "family_features", "get_spec", "hardware_problems", "resolve_name"]
