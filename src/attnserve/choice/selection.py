"""Which attention backend serves prefill and which serves decode, and why.

Policy first, availability second, both recorded in a trace:

1. POLICY is SGLang's `get_default_attn_backend` written as a table: the first
   row whose conditions all hold names SGLang's choice, and the row's `why`
   says which regression or limit put it there.
2. That choice heads a candidate list; FALLBACK_ORDER (our own order per
   platform, see its comment) follows it. Each candidate is checked against
   its `features` (base.unsupported), the machine (registry.hardware_problems),
   the conditional limits in LIMITS, and, unless `sglang=True`, whether
   attnserve implements it. The first that passes wins; every rejection is a
   trace entry with its reasons.
3. Measured beats assumed: with `use_tuned` (the engine's and `attnserve select`'s
   default), a current `attnserve tune` result for this machine and model shape
   (choice/tuned.py) puts its winner per side ahead of the policy's choice,
   and the trace cites the file, its date and the margin over the runner-up.

SGLang backends attnserve does not implement: by default (`sglang=False`, what
the engine asks for) they are rejected with "not implemented in attnserve" and
the next candidate is tried, so the answer can always be instantiated. With
`sglang=True` the question is "what would SGLang pick on that machine", and only
features, hardware and installed packages count.

An explicit choice (`attention_backend`, `prefill_backend`, `decode_backend`) is
validated the same way and is never silently replaced: if it can't run, a
ValueError names every reason and the backends that would run instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from attnserve.attention.base import AttentionRequirements, BackendFeatures, unsupported
from attnserve.attention.kernels.resolve import describe_kernels
from attnserve.choice.measured import attention_key, describe_order, measured_order
from attnserve.choice.registry import REGISTRY, get_spec, hardware_problems, resolve_name
from attnserve.choice.tuned import TunedChoice, find_tuned
from attnserve.hardware import Hardware
from attnserve.kvcache.dtypes import canonical_kv_dtype
from attnserve.kvcache.pool import check_page_size
from attnserve.shape import AttentionShape

SIDES = ("prefill", "decode")


# ---- inputs ----------------------------------------------------------------------------------------
# The model is an `AttentionShape` (attnserve.shape) as one tensor-parallel rank sees it (`shape.per_rank`).


@dataclass(frozen=True)
class ServingFeatures:
    """Serving flags that constrain the backend."""

    speculative_topk: int = 0  # 0: no speculative decoding
    page_size: int | None = None  # None: 1, or the page size the chosen backend needs
    kv_cache_dtype: str = "bf16"
    deterministic: bool = False
    dtypes: str = ""  # how the model and KV dtypes were resolved (attnserve.dtypes.Dtypes.describe), for the trace

    def __post_init__(self):
        if self.speculative_topk < 0:
            raise ValueError(f"speculative_topk must be >= 0, got {self.speculative_topk}")
        if self.page_size is not None:
            check_page_size(self.page_size)
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_dtype(self.kv_cache_dtype))


# ---- the policy table --------------------------------------------------------------------------------
@dataclass(frozen=True)
class When:
    """Conditions of a policy or limit row; a field left None always holds."""

    attention: str | None = None  # "MHA" (MHA or GQA) or "MLA"
    device: str | None = None
    cc_major: tuple[int, ...] | None = None  # NVIDIA compute capability majors
    min_cuda: tuple[int, int] | None = None
    max_topk: int | None = None  # speculative topk at most this
    min_topk: int | None = None
    min_page_size: int | None = None
    kv_widths_differ: bool | None = None
    sinks: bool | None = None
    arch: tuple[str, ...] | None = None  # host CPU architectures
    vendor: str | None = None
    model_types: tuple[str, ...] | None = None
    heads_per_rank: tuple[int, ...] | None = None
    kv_dtypes: tuple[str, ...] | None = None

    def holds(self, hw: Hardware, model: AttentionShape, serving: ServingFeatures, page_size: int = 1) -> bool:
        attention = "MLA" if model.attention_type == "MLA" else "MHA"
        topk = serving.speculative_topk
        checks = (
            (self.attention, lambda v: v == attention),
            (self.device, lambda v: v == hw.device),
            (self.cc_major, lambda v: hw.compute_capability is not None and hw.compute_capability[0] in v),
            (self.min_cuda, lambda v: hw.cuda_version is not None and hw.cuda_version >= v),
            (self.max_topk, lambda v: topk <= v),
            (self.min_topk, lambda v: topk >= v),
            (self.min_page_size, lambda v: page_size >= v),
            (self.kv_widths_differ, lambda v: model.kv_widths_differ == v),
            (self.sinks, lambda v: model.has_sinks == v),
            (self.arch, lambda v: hw.arch in v),
            (self.vendor, lambda v: hw.vendor == v),
            (self.model_types, lambda v: model.model_type in v),
            (self.heads_per_rank, lambda v: model.num_q_heads in v),
            (self.kv_dtypes, lambda v: serving.kv_cache_dtype in v),
        )
        return all(want is None or test(want) for want, test in checks)


@dataclass(frozen=True)
class PolicyRow:
    when: When
    choose: str
    why: str


_HOPPER = (9,)
_BLACKWELL = (10,)  # SM100 / SM103
_DSV3 = ("deepseek_v3", "deepseek_r1", "kimi_k2")
_ARM = ("aarch64", "arm64")

# SGLang's get_default_attn_backend (v0.5.22), first matching row wins. One row per line of policy.
POLICY: tuple[PolicyRow, ...] = (
    # --- MLA models ---
    PolicyRow(When(attention="MLA", device="cuda", cc_major=_BLACKWELL, model_types=_DSV3), "trtllm_mla",
              "DeepSeek-V3/R1 on SM100: TensorRT-LLM MLA kernels are SGLang's model override"),
    PolicyRow(When(attention="MLA", device="cuda", cc_major=_HOPPER, min_cuda=(12, 3)), "fa3",
              "MLA on Hopper with CUDA >= 12.3: fa3 is SGLang's default"),
    PolicyRow(When(attention="MLA", device="cuda", cc_major=_BLACKWELL), "flashinfer",
              "MLA on SM100: FlashInfer MLA is SGLang's default"),
    PolicyRow(When(attention="MLA", device="rocm", heads_per_rank=(16, 128)), "aiter",
              "MLA on AMD with 16 or 128 heads per rank: aiter's MLA kernels cover these head counts"),
    PolicyRow(When(attention="MLA", device="rocm"), "triton",
              "MLA on AMD with a head count aiter lacks: triton"),
    # --- MHA / GQA models ---
    PolicyRow(When(attention="MHA", device="cuda", cc_major=_HOPPER, min_cuda=(12, 3), max_topk=1), "fa3",
              "Hopper, CUDA >= 12.3, speculative topk <= 1: fa3 became the default after FlashInfer 0.6.1 "
              "made Hopper decode ~7x slower (SGLang issue 17411: ITL 39.44 -> 283.52 ms, fa3 56.73 ms)"),
    PolicyRow(When(attention="MHA", device="cuda", cc_major=_BLACKWELL, max_topk=1, kv_widths_differ=True), "fa4",
              "SM100 with different K and V head widths: fa4 handles asymmetric heads"),
    PolicyRow(When(attention="MHA", device="cuda", cc_major=_BLACKWELL, max_topk=1), "trtllm_mha",
              "SM100, speculative topk <= 1: TensorRT-LLM MHA kernels are SGLang's Blackwell default"),
    PolicyRow(When(attention="MHA", device="rocm"), "aiter", "AMD ROCm: aiter is SGLang's default for MHA"),
    # --- platforms without CUDA (any attention type) ---
    PolicyRow(When(device="mps"), "torch_native", "Apple MPS: torch_native is SGLang's default"),
    PolicyRow(When(device="cpu", arch=_ARM), "torch_native", "ARM64 CPU: torch_native is SGLang's default"),
    PolicyRow(When(device="cpu", vendor="intel"), "intel_amx", "Intel x86 CPU: SGLang's AMX kernels"),
    PolicyRow(When(device="cpu"), "torch_native", "CPU: torch_native (attnserve row; no GPU kernels apply)"),
    PolicyRow(When(device="xpu"), "intel_xpu", "Intel GPU: SGLang's XPU backend"),
    PolicyRow(When(device="npu"), "ascend", "Huawei NPU: SGLang's Ascend backend"),
    # --- everything else on NVIDIA ---
    PolicyRow(When(attention="MLA"), "triton", "MLA elsewhere: triton"),
    PolicyRow(When(sinks=True), "triton", "the model has attention sinks, which FlashInfer can't run: triton"),
    PolicyRow(When(), "flashinfer", "no earlier rule applies: FlashInfer is SGLang's general NVIDIA default"),
)

# Candidates tried after the policy's choice, per platform. attnserve's own order: on NVIDIA, FlashInfer
# first (tensor-core paged decode and fa3 prefill), then attnserve's Triton
# kernels (portable, CUDA graphs), then FlexAttention (no CUDA graphs), then torch_native (reference
# speed). On a GPU model with a shipped race (choice/measured_order.json), its measured order goes first.
FALLBACK_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flashinfer", "triton", "flex_attention", "torch_native"),
    "rocm": ("triton", "flex_attention", "torch_native"),
    "cpu": ("torch_native", "flex_attention"),
    "mps": ("torch_native",),
    "xpu": ("torch_native",),
    "npu": ("torch_native",),
}


@dataclass(frozen=True)
class Limit:
    backend: str
    when: When
    why: str
    attnserve_only: bool = False  # a limit of attnserve's implementation, not of SGLang's backend of that name


# Limits SGLang enforces that a backend's feature flags can't express (they depend on a combination).
LIMITS: tuple[Limit, ...] = (
    Limit("fa3", When(attention="MLA", min_topk=2, min_page_size=2),
          "MLA with speculative topk > 1 needs page size 1 on fa3"),
    Limit("triton", When(attention="MLA", min_topk=2, min_page_size=2),
          "MLA with speculative topk > 1 needs page size 1 on triton"),
    Limit("flashinfer", When(attention="MLA", kv_dtypes=("fp8_e5m2",)),
          "FlashInfer's MLA wrapper reads FP8 e4m3 latents only (triton's MLA kernels read both)", attnserve_only=True),
    Limit("flashinfer", When(attention="MLA", kv_dtypes=("fp8_e4m3",), cc_major=(7, 8, 10, 11, 12)),
          "FlashInfer's MLA wrapper reads FP8 latents on SM90 only (triton's MLA kernels read them anywhere)",
          attnserve_only=True),
    Limit("flashinfer", When(attention="MLA", min_topk=2),
          "FlashInfer's MLA wrapper has no custom masks for tree speculative decoding", attnserve_only=True),
)

# Page size SGLang forces when the user sets none and the backend needs a specific one.
PREFERRED_PAGE_SIZE: dict[str, int] = {"trtllm_mha": 64, "trtllm_mla": 64, "flashmla": 64, "hpc_ops": 64,
                                       "cutlass_mla": 128, "fa4": 128}


# ---- the trace -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceEntry:
    """One step of the decision. kind: input, policy, tuned, candidate, reject, accept, explicit, adjust, kernel
    (the kernel a chosen backend runs for this shape)."""

    kind: str
    reason: str
    backend: str | None = None
    side: str | None = None  # prefill, decode, or None for both

    def to_dict(self) -> dict:
        return {"kind": self.kind, "side": self.side, "backend": self.backend, "reason": self.reason}

    def __str__(self) -> str:
        where = f"[{self.side}] " if self.side else ""
        who = f"{self.backend}: " if self.backend else ""
        return f"{self.kind:9s} {where}{who}{self.reason}"


@dataclass
class Selection:
    prefill_backend: str
    decode_backend: str
    page_size: int
    cuda_graph: bool  # decode CUDA graphs possible with the decode backend
    policy_choice: str  # what SGLang's policy table names
    trace: list[TraceEntry] = field(default_factory=list)

    @property
    def is_hybrid(self) -> bool:
        return self.prefill_backend != self.decode_backend

    def to_dict(self) -> dict:
        """The fields in their order, each trace entry in its own key order (select --json)."""
        return {**dataclasses.asdict(self), "trace": [e.to_dict() for e in self.trace]}

    def describe(self) -> str:
        head = (f"prefill: {self.prefill_backend}   decode: {self.decode_backend}   page size: {self.page_size}"
                f"   CUDA graphs: {'yes' if self.cuda_graph else 'no'}")
        return "\n".join([head, "trace:"] + [f"  {e}" for e in self.trace])


# ---- checking one candidate -------------------------------------------------------------------------------
def policy_row(hw: Hardware, model: AttentionShape, serving: ServingFeatures) -> PolicyRow:
    for row in POLICY:
        if row.when.holds(hw, model, serving):
            return row
    raise AssertionError("the last policy row matches everything")  # pragma: no cover


_ANY_ATTENTION = frozenset({"MHA", "GQA", "MLA"})

# Where SGLang's backend of a name differs from attnserve's (SGLang docs feature table, v0.5.22);
# `sglang=True` reads features through these so its answers don't drift with our implementations.
SGLANG_FEATURES: dict[str, dict] = {
    "flashinfer": {"attention_types": _ANY_ATTENTION, "deterministic": True},
    "triton": {"attention_types": _ANY_ATTENTION, "sliding_window": True, "attention_sinks": True,
               "asymmetric_kv": True, "spec_topk1": True, "spec_topk_gt1": True, "spec_topk_gt1_paged": True,
               "deterministic": True, "cuda_graph": True, "devices": frozenset({"cuda", "rocm"})},
    "torch_native": {"spec_topk1": False, "spec_topk_gt1": False, "spec_topk_gt1_paged": False},
    "flex_attention": {"sliding_window": False, "spec_topk1": False, "spec_topk_gt1": False,
                       "spec_topk_gt1_paged": False},
    # SGLang runs fa4 on Blackwell at its native page 128; attnserve's also on Hopper, at any page size
    "fa4": {"page_sizes": (128,), "compute_capabilities": (10,), "head_dims": None, "sliding_window": False,
            "logit_softcap": False, "cuda_graph": True},
}


def _features(name: str, sglang: bool = False) -> tuple[BackendFeatures | None, str | None]:
    """A backend's features, or why they can't be read (its implementation failed to import)."""
    try:
        feats = get_spec(name).features
    except ImportError as exc:
        if not sglang or name not in SGLANG_FEATURES:
            return None, f"implementation not importable ({exc})"
        feats = BackendFeatures(required_packages=("triton",) if name == "triton" else ())
    if sglang and name in SGLANG_FEATURES:
        feats = dataclasses.replace(feats, **SGLANG_FEATURES[name])
    return feats, None


def requirements(model: AttentionShape, serving: ServingFeatures, side: str | None, page_size: int) -> AttentionRequirements:
    return AttentionRequirements(
        attention_type=model.attention_type,
        head_dim=model.head_dim,
        v_head_dim=model.v_head_dim,
        page_size=page_size,
        kv_dtype=serving.kv_cache_dtype,
        sliding_window=model.sliding_window is not None,
        attention_sinks=model.has_sinks,
        logit_softcap=model.logit_softcap is not None,
        spec_topk=serving.speculative_topk,
        needs_prefill=side in (None, "prefill"),
        needs_decode=side in (None, "decode"),
    )


def page_size_for(name: str, serving: ServingFeatures, fixed: int | None) -> int:
    """The page size a candidate would run at: the user's or another side's, else the one it needs."""
    if serving.page_size is not None:
        return serving.page_size
    if fixed is not None:
        return fixed
    return PREFERRED_PAGE_SIZE.get(name, 1)


def problems(
    name: str,
    hw: Hardware,
    model: AttentionShape,
    serving: ServingFeatures,
    side: str | None = None,
    page_size: int = 1,
    sglang: bool = False,
) -> list[str]:
    """Every reason backend `name` can't serve `side` (None: both) here; empty when it can."""
    spec = get_spec(name)
    why: list[str] = []
    if spec.removed:
        why.append(f"removed from SGLang ({spec.removed})")
    if not sglang and not spec.implemented:
        why.append("not implemented in attnserve (known from SGLang)")
    feats, err = _features(spec.name, sglang)
    if feats is None:
        return why + [err]
    why += hardware_problems(feats, hw)
    why += unsupported(feats, requirements(model, serving, side, page_size))
    if serving.deterministic and not feats.deterministic:
        why.append("no deterministic mode")
    why += [lim.why for lim in LIMITS if lim.backend == spec.name and not (sglang and lim.attnserve_only)
            and lim.when.holds(hw, model, serving, page_size)]
    return why


def runnable_backends(hw: Hardware, model: AttentionShape, serving: ServingFeatures, side: str | None = None,
                      page_size: int | None = None, sglang: bool = False) -> list[str]:
    """Every backend that passes all checks, in registry order (what an error message offers)."""
    out = []
    for name in REGISTRY:
        ps = page_size if page_size is not None else page_size_for(name, serving, None)
        if not problems(name, hw, model, serving, side, ps, sglang):
            out.append(name)
    return out


# ---- the decision ---------------------------------------------------------------------------------------
def candidate_order(hw: Hardware, row: PolicyRow, trace: list[TraceEntry], side: str,
                    tuned: TunedChoice | None = None, attention: str = "MHA", heads: int | None = None) -> list[str]:
    """The tuned winner for this side (if any), the policy's choice, the shipped measured order for this
    attention type ('MHA' or 'MLA') and query heads per rank, the static one."""
    order = []
    winner = tuned.winners.get(side) if tuned else None
    if winner is not None:
        versus = (f", {winner.ratio:.2f}x faster than {winner.runner_up}" if winner.runner_up and winner.ratio
                  else ", the only backend raced")
        trace.append(TraceEntry("tuned", f"measured fastest for {side} on this machine and model shape: "
                                f"{tuned.path} ({tuned.date}){versus}", winner.backend, side))
        order.append(winner.backend)
    if row.choose not in order:
        order.append(row.choose)
    shipped = measured_order(hw, side, attention, heads)
    measured = shipped[0] if shipped else ()
    if shipped:
        raced = shipped[1].get("heads")
        at = "" if raced is None else f" at {raced} query heads" + (
            "" if raced == heads else f" (the raced head count nearest {heads})")
        trace.append(TraceEntry("input", f"fallback order measured on this GPU model for {attention}{at}: "
                                f"{describe_order(shipped[1], side)} (mean time relative to each workload's "
                                f"fastest; {shipped[1].get('source')}, {shipped[1].get('date')})", side=side))
    for name in (*measured, *FALLBACK_ORDER.get(hw.device, ("torch_native",))):
        if name not in order:
            order.append(name)
    return order


def _tuned_choice(hw: Hardware, model: AttentionShape, serving: ServingFeatures, use_tuned: bool,
                  tune_dir: Path | None, trace: list[TraceEntry]) -> TunedChoice | None:
    if not use_tuned:
        return None
    if hw.installed is None:
        trace.append(TraceEntry("tuned", "tune results describe this machine; not read for a hypothetical one"))
        return None
    choice, notes = find_tuned(hw, model, serving.kv_cache_dtype, serving.page_size, tune_dir)
    trace.extend(TraceEntry("tuned", note) for note in notes)
    return choice


def select_backends(
    hw: Hardware,
    model: AttentionShape,
    serving: ServingFeatures | None = None,
    attention_backend: str | None = None,
    prefill_backend: str | None = None,
    decode_backend: str | None = None,
    sglang: bool = False,
    speculative_attention_mode: str = "prefill",
    use_tuned: bool = False,
    tune_dir: Path | None = None,
) -> Selection:
    """Resolve the prefill and decode backends; raise ValueError if an explicit choice can't run.

    `sglang=True` asks what SGLang would pick (unimplemented backends count); the default asks what
    attnserve can instantiate. Side flags override `attention_backend` for their side, as in SGLang.
    `use_tuned`: a side without an explicit backend tries first the winner of a current `attnserve tune`
    result for this machine and shape (in `tune_dir`, default the user's cache); the engine and
    `attnserve select` ask for it unless --no-tuned.
    """
    serving = serving or ServingFeatures()
    if speculative_attention_mode not in SIDES:
        raise ValueError(f"speculative_attention_mode must be prefill or decode, got {speculative_attention_mode!r}")
    trace: list[TraceEntry] = [
        TraceEntry("input", f"hardware: {hw.describe()}"
                   + ("" if hw.installed is None else f"; installed: {', '.join(sorted(hw.installed)) or 'nothing'}")
                   + ("; hypothetical machine, every package counts as installed" if hw.installed is None else "")),
        TraceEntry("input", _describe_model(model)),
        TraceEntry("input", _describe_serving(serving)),
        TraceEntry("input", "resolving among SGLang's backends (unimplemented ones count)" if sglang
                   else "resolving among backends attnserve implements"),
    ]
    row = policy_row(hw, model, serving)
    trace.append(TraceEntry("policy", row.why, row.choose))

    explicit = {"prefill": prefill_backend or attention_backend, "decode": decode_backend or attention_backend}
    # a measured winner stands in for the policy only where no backend was named, and only for attnserve itself
    open_side = any(explicit[side] is None for side in SIDES)
    tuned = _tuned_choice(hw, model, serving, use_tuned and open_side and not sglang, tune_dir, trace)
    chosen: dict[str, str] = {}
    fixed_page: int | None = serving.page_size
    for side in SIDES:
        want = explicit[side]
        if want is not None:
            name = resolve_name(want)
            ps = page_size_for(name, serving, fixed_page)
            why = problems(name, hw, model, serving, side, ps, sglang)
            if why:
                others = [n for n in runnable_backends(hw, model, serving, side, fixed_page, sglang) if n != name]
                raise ValueError(
                    f"attention backend {name!r} cannot serve {side} here: {'; '.join(why)}. "
                    f"Backends that would: {', '.join(others) or 'none'}"
                )
            trace.append(TraceEntry("explicit", f"requested for {side}; passes every check", name, side))
        else:
            candidates = candidate_order(hw, row, trace, side, tuned, attention_key(model.attention_type),
                                         model.num_q_heads)
            name, ps = _first_passing(candidates, hw, model, serving, side, fixed_page, sglang, trace)
        chosen[side] = name
        if fixed_page is None and (name in PREFERRED_PAGE_SIZE or _fixed_page_sizes(name, sglang)):
            fixed_page = ps
            trace.append(TraceEntry("adjust", f"page size {ps}: {name} needs it", name, side))
    page_size = fixed_page if fixed_page is not None else 1
    if page_size != 1 and serving.page_size is None:
        # the prefill side was chosen before the page size was fixed by the decode side: recheck it
        why = problems(chosen["prefill"], hw, model, serving, "prefill", page_size, sglang)
        if why:
            raise ValueError(f"prefill backend {chosen['prefill']!r} can't run at page size {page_size} that "
                             f"decode backend {chosen['decode']!r} needs: {'; '.join(why)}")
    decode_feats, _ = _features(chosen["decode"], sglang)
    cuda_graph = bool(decode_feats and decode_feats.cuda_graph) and hw.device in ("cuda", "rocm")
    if not cuda_graph and hw.device in ("cuda", "rocm"):
        trace.append(TraceEntry("adjust", "CUDA graphs disabled: the decode backend can't be captured",
                                chosen["decode"], "decode"))
    if chosen["prefill"] != chosen["decode"]:
        trace.append(TraceEntry("adjust", "prefill and decode differ: one hybrid backend routes by forward mode"))
    if serving.speculative_topk:
        verify = chosen[speculative_attention_mode]
        trace.append(TraceEntry("adjust", f"speculative verify runs on the {speculative_attention_mode} backend "
                                f"(speculative attention mode {speculative_attention_mode})", verify))
    for side in SIDES:  # the kernel each side's backend runs for this shape (kernels/plan.py)
        kernel = describe_kernels(chosen[side], side, hw, model, page_size, serving.kv_cache_dtype)
        if kernel is not None:
            trace.append(TraceEntry("kernel", f"{side}: {kernel}"))
    return Selection(chosen["prefill"], chosen["decode"], page_size, cuda_graph, row.choose, trace)


def _fixed_page_sizes(name: str, sglang: bool) -> bool:
    feats, _ = _features(name, sglang)
    return feats is not None and feats.page_sizes is not None


def _first_passing(candidates, hw, model, serving, side, fixed_page, sglang, trace) -> tuple[str, int]:
    tried = []
    for name in candidates:
        ps = page_size_for(name, serving, fixed_page)
        why = problems(name, hw, model, serving, side, ps, sglang)
        if not why:
            trace.append(TraceEntry("accept", "passes every check", name, side))
            return name, ps
        tried.append(f"{name} ({'; '.join(why)})")
        trace.append(TraceEntry("reject", "; ".join(why), name, side))
    rest = [n for n in runnable_backends(hw, model, serving, side, fixed_page, sglang) if n not in candidates]
    if rest:
        name = rest[0]
        ps = page_size_for(name, serving, fixed_page)
        trace.append(TraceEntry("accept", "first backend outside the candidate list that passes every check",
                                name, side))
        return name, ps
    raise ValueError(f"no attention backend can serve {side} here; tried: {', '.join(tried)}")


def _describe_model(m: AttentionShape) -> str:
    extra = [t for t, on in (("sliding window", m.sliding_window is not None), ("attention sinks", m.has_sinks),
                             ("logit soft-cap", m.logit_softcap is not None)) if on]
    v = f", V width {m.v_head_dim}" if m.v_head_dim != m.head_dim else ""
    return (f"model: {m.name or m.model_type or 'custom'}, {m.attention_type}, {m.num_q_heads} query / "
            f"{m.num_kv_heads} KV heads per rank, head_dim {m.head_dim}{v}" + (f", {', '.join(extra)}" if extra else ""))


def _describe_serving(s: ServingFeatures) -> str:
    spec = f"speculative topk {s.speculative_topk}" if s.speculative_topk else "no speculative decoding"
    page = f"page size {s.page_size}" if s.page_size is not None else "page size unset"
    det = ", deterministic" if s.deterministic else ""
    how = f"; {s.dtypes}" if s.dtypes else ""
    return f"serving: {spec}, {page}, KV {s.kv_cache_dtype}{det}{how}"


__all__ = ["FALLBACK_ORDER", "LIMITS", "POLICY", "Limit", "PolicyRow", "Selection",
           "ServingFeatures", "TraceEntry", "When", "measured_order", "policy_row", "problems",
           "runnable_backends", "select_backends"]
