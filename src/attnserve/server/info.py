"""What /server_info reports: the engine's fixed choices (read once, in the engine process) and its state
(read per call over the engine channel)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from attnserve.engine.engine import Engine
from attnserve.engine.startup import verify_backend

_PACKAGES = ("attnserve", "torch", "triton", "flashinfer-python", "transformers", "fastapi", "uvicorn")


def versions() -> dict[str, str | None]:
    """Installed versions from package metadata (importing torch's peers here would be slow or fail)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if "torch" in sys.modules:
        import torch

        found["cuda"] = torch.version.cuda
    return found


def speculation_info(engine: Engine) -> dict | None:
    """The speculative decoding settings (None when the engine does not speculate)."""
    c = engine.config
    if c.speculative_algorithm is None:
        return None
    return {"algorithm": c.speculative_algorithm, "num_draft_tokens": c.speculative_num_draft_tokens,
            "num_steps": c.speculative_num_steps, "eagle_topk": c.speculative_eagle_topk,
            "ngram_match_window": [c.speculative_ngram_min_match_window_size,
                                   c.speculative_ngram_max_match_window_size],
            "attention_mode": c.speculative_attention_mode,
            "verify_backend": verify_backend(c, engine.parts.attention)}


def static_info(engine: Engine) -> dict:
    parts = engine.parts
    return {
        "model_path": engine.config.model,
        "device": str(parts.model.device),
        "dtype": str(parts.model.dtype).removeprefix("torch."),
        "context_length": engine.max_context_len,
        "attention_backend": {"prefill": parts.attention.prefill_backend, "decode": parts.attention.decode_backend},
        "selection_trace": list(parts.attention.trace),
        "cuda_graph_batch_sizes": list(parts.graphs.batch_sizes),
        "max_running_requests": engine.config.max_running_requests,
        "chunked_prefill_size": engine.config.chunked_prefill_size,
        "radix_cache": not engine.config.disable_radix_cache,
        "deterministic_inference": engine.config.enable_deterministic_inference,
        "speculative": speculation_info(engine),
        "startup_log": list(parts.startup_lines),
        "versions": versions(),
    }
