"""Session-wide test set-up.

Without CUDA, Triton kernels run through the Triton interpreter; the variable must be set
before the first `import triton`, so it is set here, before any test module is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
