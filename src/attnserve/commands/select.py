"""`attnserve select`: which attention backends would serve prefill and decode, and why, without a model.

With no --gpu it describes this machine and checks what is installed here; with
--gpu the machine is hypothetical and every package counts as installed unless
--installed lists what is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.dtypes import Dtypes, resolve_dtypes
from attnserve.hardware import PRESET_HARDWARE, detect_hardware
from attnserve.models.config import attention_shape_of, stated_dtype_of
from attnserve.shape import GENERIC_GQA

# what --sliding-window / --logit-softcap without a value stand for (Mistral's window, Gemma-2's cap)
DEFAULT_FLAG_WINDOW = 4096
DEFAULT_FLAG_SOFTCAP = 50.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_parser(sub) -> argparse.ArgumentParser:

    p = sub.add_parser(
        "select",
        help="show the attention backends chosen for a GPU, model and features, with the reasons",
        description="Resolve the prefill and decode attention backends and print every rule applied and "
        "every candidate rejected. Loads no model.",
    )
    add_machine_arguments(p)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="a preset name, a HF config.json or a .gguf file (default: a generic GQA model)")
    m.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (heads per rank)")
    m.add_argument("--attention-sinks", action="store_true", help="the model has attention sinks")
    m.add_argument("--v-head-dim", type=int, default=None, help="V head width when it differs from K's")
    m.add_argument("--sliding-window", type=_positive_int, nargs="?", const=DEFAULT_FLAG_WINDOW, default=None,
                   metavar="TOKENS", help="the model uses sliding-window attention (of TOKENS; default "
                   f"{DEFAULT_FLAG_WINDOW}: selection only asks whether there is one)")
    m.add_argument("--logit-softcap", type=_positive_float, nargs="?", const=DEFAULT_FLAG_SOFTCAP, default=None,
                   metavar="CAP", help="the model soft-caps attention logits (at CAP; default "
                   f"{DEFAULT_FLAG_SOFTCAP:g})")
    f = p.add_argument_group("features")
    f.add_argument("--speculative-topk", "--speculative-eagle-topk", type=int, default=0,
                   help="speculative decoding's draft-tree branching (1: chains; 0: no speculative decoding)")
    f.add_argument("--page-size", type=int, default=None, help="KV page size (default: 1 or what the backend needs)")
    f.add_argument("--dtype", default="auto",
                   help="model dtype, as the engine's --dtype: auto (CPU: bf16 where it has AMX or AVX512-BF16, "
                   "else fp32; GPU: the checkpoint's, bf16 if unstated), bf16, fp16, fp32")
    f.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (as the engine: the model dtype), bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
    f.add_argument("--deterministic", action="store_true", help="require deterministic attention")
    b = p.add_argument_group("explicit choices (validated, never replaced)")
    b.add_argument("--attention-backend", default=None)
    b.add_argument("--prefill-attention-backend", default=None)
    b.add_argument("--decode-attention-backend", default=None)
    b.add_argument("--speculative-attention-mode", choices=("prefill", "decode"), default="prefill",
                   help="which side runs speculative verify steps (default: prefill)")
    b.add_argument("--sglang", action="store_true",
                   help="answer as SGLang would: backends attnserve does not implement count too")
    b.add_argument("--no-tuned", action="store_true",
                   help="ignore `attnserve tune` results (by default a current one for this machine and model "
                   "shape puts its measured winner first)")
    p.add_argument("--json", action="store_true",
                   help='print {"prefill_backend", "decode_backend", "trace", ...} as JSON')
    return p


def add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpu / --installed / --cuda-version: this machine, or a hypothetical one (select and backends)."""
    hw = parser.add_argument_group("machine")
    hw.add_argument("--gpu", choices=sorted(PRESET_HARDWARE), default=None,
                    help="a hypothetical machine (default: this one, with what is installed here)")
    hw.add_argument("--installed", default=None, metavar="PKG,PKG",
                    help="with --gpu: the packages installed there (default: all), e.g. triton,flashinfer")
    hw.add_argument("--cuda-version", default=None, metavar="MAJOR.MINOR", help="with --gpu: override CUDA version")


def hardware_from_args(args):
    if args.gpu is None:
        if args.installed or args.cuda_version:
            raise ValueError("--installed and --cuda-version describe a hypothetical machine; add --gpu NAME")
        return detect_hardware()
    hw = PRESET_HARDWARE[args.gpu]
    if args.installed is not None:
        pkgs = frozenset(p.strip() for p in args.installed.split(",") if p.strip()) | {"torch"}
        hw = dataclasses.replace(hw, installed=pkgs)
    if args.cuda_version:
        try:
            major, minor = (int(x) for x in args.cuda_version.split("."))
        except ValueError:
            raise ValueError(f"--cuda-version must look like 12.4, got {args.cuda_version!r}") from None
        hw = dataclasses.replace(hw, cuda_version=(major, minor))
    return hw


def model_from_args(args):
    """The AttentionShape one tensor-parallel rank sees: a preset, config.json or .gguf (or a generic GQA model),
    with the feature flags forced on."""
    shape = GENERIC_GQA if args.model is None else attention_shape_of(args.model, args.tp_size)
    overrides = {}
    if args.attention_sinks:
        overrides["has_sinks"] = True
    if args.sliding_window is not None:
        overrides["sliding_window"] = args.sliding_window
    if args.logit_softcap is not None:
        overrides["logit_softcap"] = args.logit_softcap
    if args.v_head_dim is not None:
        if args.v_head_dim < 1:
            raise ValueError(f"--v-head-dim must be >= 1, got {args.v_head_dim}")
        overrides["v_head_dim"] = args.v_head_dim
    return dataclasses.replace(shape, **overrides) if overrides else shape


def dtypes_from_args(args, hw) -> Dtypes:
    """--dtype and --kv-cache-dtype as the engine resolves them on this machine description (attnserve.dtypes)."""
    return resolve_dtypes(hw.device, hw.cpu_bf16, args.dtype, args.kv_cache_dtype, stated_dtype_of(args.model))


def run(args) -> int:
    hw = hardware_from_args(args)
    model = model_from_args(args)
    dtypes = dtypes_from_args(args, hw)
    serving = ServingFeatures(speculative_topk=args.speculative_topk, page_size=args.page_size,
                              kv_cache_dtype=dtypes.kv_cache, deterministic=args.deterministic,
                              dtypes=dtypes.describe())
    selection = select_backends(
        hw, model, serving,
        attention_backend=args.attention_backend,
        prefill_backend=args.prefill_attention_backend,
        decode_backend=args.decode_attention_backend,
        sglang=args.sglang,
        speculative_attention_mode=args.speculative_attention_mode,
        use_tuned=not args.no_tuned,
    )
    if args.json:
        json.dump({**selection.to_dict(), "dtype": dtypes.model_name, "kv_cache_dtype": dtypes.kv_cache}, sys.stdout,
                  indent=2)
        sys.stdout.write("\n")
    else:
        print(selection.describe())
    return 0
