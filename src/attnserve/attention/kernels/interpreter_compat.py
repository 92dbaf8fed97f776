"""Triton 3.6's interpreter under numpy >= 2.4: loaded scalars as loop bounds.

The interpreter keeps every scalar (a loaded sequence length, a program id) as a one-element 1-D numpy
array and turns it into a Python int for `range(lo, hi, BLOCK_N)` with `int(array)`, which numpy 2.4
made an error ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171,
fixed after 3.6). Every kernel whose loop bounds come from memory then fails on the CPU. Reading the
single element is what the interpreter meant; compiled kernels never run this code.

Applied explicitly where the library runs kernels under TRITON_INTERPRET=1 (the triton backend on a CPU
pool: `attnserve tune --backends triton`, the tiny benchmark races; the tests' conftest), never on import.
"""

from __future__ import annotations

import numpy as np


def interpreter_needs_scalar_index_fix() -> bool:
    """Whether this numpy refuses int() of a one-element 1-D array (what the interpreter does)."""
    try:
        int(np.array([1]))
    except TypeError:
        return True
    return False


def let_interpreter_index_with_loaded_scalars() -> bool:
    """Patch the interpreter's tensor `__index__` to read the single element; True once it is in place.

    Idempotent; does nothing (False) where numpy still accepts the interpreter's conversion or this Triton
    has no such hook (another version, whose interpreter then gets no help from here)."""
    if not interpreter_needs_scalar_index_fix():
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton here: nothing to help
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_scalar_index_fixed", False):
        return True

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched
    return True
