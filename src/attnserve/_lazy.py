"""Optional dependencies are imported only where used, with a message that says how to get them."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# package import name -> the pip extra (or package) that brings it
_INSTALL_HINT = {
    "triton": "pip install 'attnserve[gpu]'  (or: pip install triton)",
    "flashinfer": "pip install 'attnserve[flashinfer]'  (FlashInfer wheels for your CUDA/torch)",
    "transformers": "pip install 'attnserve[hf]'",
    "flash_attn": "pip install flash-attn-4  (FA4, CuTe DSL; Hopper or Blackwell)",
    "matplotlib": "pip install 'attnserve[bench]'",
}


class MissingDependencyError(ImportError):
    """Raised when an optional package is needed but absent; the message says how to install it."""


def is_installed(module: str) -> bool:
    """True when `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str = "") -> ModuleType:
    """Import an optional package or raise MissingDependencyError naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = _INSTALL_HINT.get(module.split(".")[0], f"pip install {module.split('.')[0]}")
        why = f" (needed for {purpose})" if purpose else ""
        raise MissingDependencyError(f"package '{module}' is not installed{why}; install it with: {hint}") from exc
