"""How many KV splits each decode request gets (Flash-Decoding's work partition).

Decode reads every KV byte once; the GPU is only busy when there are enough
(request, KV head, split) programs to fill every SM a few times over. One long
request needs many splits, a big batch needs none. The plan is made on the host
from host-side lengths (no device sync), once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SplitPolicy:
    num_sms: int = 132
    waves: float = 2.0  # target programs = waves * num_sms
    # never cut a request into chunks shorter than this. 128, not 256: at one request of ~1,150 keys, 9 splits
    # instead of 5 took Llama-3-8B's attention from 0.33 to 0.27 ms a step and DeepSeek-V2-Lite's step from 3.14 to
    # 3.09 ms on an H100 (results/engine_gpu_profile_split_*-h100.json); 64 and 32 were slower than 128
    min_split_tokens: int = 128
    max_splits: int = 64  # hard cap per request (also the partial buffers' split dimension)

    def __post_init__(self):
        for name in ("num_sms", "min_split_tokens", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"SplitPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.waves <= 0:
            raise ValueError(f"SplitPolicy.waves must be > 0, got {self.waves}")


def plan_kv_splits(
    seq_lens: list[int], num_kv_heads: int, policy: SplitPolicy, max_splits: int | None = None
) -> list[int]:
    """Splits per request: chunks of about equal token count so every program does similar work.

    The chunk length is the total KV work divided by the target program count, but at
    least `min_split_tokens`; a request of length n gets ceil(n / chunk) splits, capped at
    `max_splits` (default: the policy's cap). A request of length 0 still gets one split.
    """
    if not seq_lens:
        return []
    cap, chunk = _cap_and_chunk(sum(seq_lens), num_kv_heads, policy, max_splits)
    return [max(1, min(cap, math.ceil(n / chunk))) for n in seq_lens]


def plan_kv_splits_array(seq_lens: np.ndarray, num_kv_heads: int, policy: SplitPolicy,
                         max_splits: int | None = None) -> np.ndarray:
    """plan_kv_splits over a numpy array of lengths (thousands of rows, e.g. one per token of an extend)."""
    if seq_lens.size == 0:
        return np.zeros(0, dtype=np.int32)
    cap, chunk = _cap_and_chunk(int(seq_lens.sum()), num_kv_heads, policy, max_splits)
    return np.clip(-(-seq_lens.astype(np.int64) // chunk), 1, cap).astype(np.int32)


def _cap_and_chunk(total_tokens: int, num_kv_heads: int, policy: SplitPolicy,
                   max_splits: int | None) -> tuple[int, int]:
    """The split cap, and the chunk length: the total KV work over the target program count, at least
    `min_split_tokens`."""
    cap = policy.max_splits if max_splits is None else max(1, min(max_splits, policy.max_splits))
    target_programs = max(1, int(policy.waves * policy.num_sms))
    chunk = max(policy.min_split_tokens, math.ceil(total_tokens * num_kv_heads / target_programs))
    return cap, chunk


def max_splits_for_batch(batch_size: int, num_kv_heads: int, policy: SplitPolicy) -> int:
    """The split dimension a CUDA graph of this batch size is captured with.

    A captured grid cannot grow at replay, so it is sized for the most splits any
    request of this batch size could be given: enough for one request to fill the GPU.
    """
    target_programs = max(1, int(policy.waves * policy.num_sms))
    return max(1, min(policy.max_splits, math.ceil(target_programs / max(1, batch_size * num_kv_heads))))
