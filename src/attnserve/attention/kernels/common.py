"""Pieces every attnserve Triton kernel shares: interpreter detection and score transforms."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests); the kernels then avoid what the interpreter gets wrong.

    Triton 3.6's interpreter reads bf16 bits as another type inside tl.dot and rounds
    float->fp8 conversions wrongly near a binade's top, so kernels take a float32 dot
    and pre-round fp8 values when this is True.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_scalar_index() -> None:
    """Let the interpreter use loaded scalars as loop bounds under numpy >= 2.3.

    Triton 3.6's interpreter keeps a loaded scalar as a one-element 1-D array and turns it
    into a Python int with int(array), which numpy 2.3 made an error; `for i in range(lo, hi)`
    with lo/hi loaded from memory then fails. Reading the single element instead is what the
    interpreter meant. Compiled kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of another triton version
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_attnserve_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._attnserve_patched = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalar_index()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_dtype_is_f32(*tensors: torch.Tensor) -> bool:
    """The tl.dot inputs must be float32: under the interpreter, or when any input is float32."""
    return interpreting() or any(t.dtype == torch.float32 for t in tensors)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), written with exp so the interpreter and every GPU accept it."""
    x = tl.minimum(tl.maximum(scores / cap, -20.0), 20.0)  # tanh is +-1 in float32 beyond 9
    # tanh(x) = 1 - 2 / (exp(2x) + 1); exact at both tails (exp overflow gives 1, underflow -1)
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
