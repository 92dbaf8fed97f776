"""The kernel-race workloads and what each one costs: bytes for decode, FLOPs for prefill/extend.

Names are fixed (`decode BxN pP`, `prefill BxT`, `extend 8x(4096+512)`) so results from
different runs and machines line up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "decode", "prefill" or "extend"
    batch: int
    prefix: int  # cached tokens per request before this step
    new_tokens: int  # tokens computed this step per request (1 for decode)
    page_size: int = 1

    @property
    def seq_len(self) -> int:
        return self.prefix + self.new_tokens

    def kv_bytes(self, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Decode traffic: K and V of every token read once (queries and outputs are negligible)."""
        return self.batch * self.seq_len * num_kv_heads * head_dim * 2 * itemsize

    def flops(self, num_heads: int, head_dim: int) -> float:
        """Causal attention FLOPs: two matmuls over the visible (query, key) pairs.

        New tokens see the whole prefix and, causally, half of each other: 2*T^2*d*H for a
        fresh prompt of T tokens, the convention of FlashAttention's papers.
        """
        pairs = self.new_tokens * self.prefix + self.new_tokens * self.new_tokens / 2
        return 4.0 * head_dim * num_heads * pairs * self.batch


def _decode(batch: int, ctx: int, page: int) -> Workload:
    return Workload(f"decode {batch}x{ctx} p{page}", "decode", batch, ctx - 1, 1, page)


def _prefill(batch: int, tokens: int) -> Workload:
    return Workload(f"prefill {batch}x{tokens}", "prefill", batch, 0, tokens, 1)


WORKLOADS: list[Workload] = [
    _decode(64, 4096, 1),
    _decode(64, 4096, 16),
    _decode(128, 2048, 16),
    _decode(256, 1024, 1),
    _decode(8, 8192, 1),
    _decode(1, 32768, 1),
    _prefill(8, 2048),
    _prefill(1, 16384),
    _prefill(32, 512),
    Workload("extend 8x(4096+512)", "extend", 8, 4096, 512, 1),
]

# the same shapes scaled down, for a smoke run on the CPU under the Triton interpreter
TINY_WORKLOADS: list[Workload] = [
    _decode(4, 64, 1),
    _decode(2, 96, 16),
    _prefill(2, 48),
    Workload("extend 2x(40+24)", "extend", 2, 40, 24, 4),
]


def select(names: list[str] | None, pool: list[Workload]) -> list[Workload]:
    """Workloads whose name contains any of `names` (all when None)."""
    if not names:
        return list(pool)
    chosen = [w for w in pool if any(n in w.name for n in names)]
    if not chosen:
        raise ValueError(f"no workload matches {names}; known: {', '.join(w.name for w in pool)}")
    return chosen
