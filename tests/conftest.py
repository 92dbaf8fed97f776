"""Session-wide test set-up.

Without CUDA, Triton kernels run through the Triton interpreter; the variable must be set
before the first `import triton`, so it is set here, before any test module is imported.
"""

import os
import tempfile

import torch

# Tune results are read from the user's cache by default (attention/tuned.py): tests never see a developer's
# own results, only what they write themselves into this empty directory (tests point it elsewhere as needed).
os.environ["ATTNSERVE_CACHE_DIR"] = os.path.join(tempfile.mkdtemp(prefix="attnserve-test-cache-"), "cache")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _let_the_interpreter_index_with_loaded_scalars() -> None:
    """Let Triton 3.6's interpreter use loaded scalars as loop bounds under numpy >= 2.3.

    The interpreter keeps a loaded scalar as a one-element 1-D array and turns it into a
    Python int with int(array), which numpy 2.3 made an error; `for i in range(lo, hi)` with
    lo/hi loaded from memory then fails. Reading the single element is what the interpreter
    meant. Compiled kernels never go through this code.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton here: nothing to help
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _let_the_interpreter_index_with_loaded_scalars()
