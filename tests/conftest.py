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


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # the kernel tests launch kernels directly, not through the backend that applies it
    from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

    let_interpreter_index_with_loaded_scalars()
