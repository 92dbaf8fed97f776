"""The kernel-race workloads and what each one costs: bytes for decode, FLOPs for prefill/extend.

Names are fixed (`decode BxN pP`, `prefill BxT`, `extend 8x(4096+512)`, `mla decode BxN hH pP`)
so results from different runs and machines line up. MLA workloads (DeepSeek's absorbed
attention over the 512 + 64 latent) run only when asked for by a name containing "mla".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAShape:
    num_heads: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    qk_head_dim: int = 192  # nope + rope before absorption: the softmax scale is its -1/2 power

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "decode", "prefill" or "extend"
    batch: int
    prefix: int  # cached tokens per request before this step
    new_tokens: int  # tokens computed this step per request (1 for decode)
    page_size: int = 1
    mla: MLAShape | None = None  # an MLA workload: query heads and latent widths

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

    def mla_bytes(self, itemsize: int) -> int:
        """MLA traffic: every latent row (rank + rope) read once: B * n * 576 * 2 for DeepSeek in bf16."""
        return self.batch * self.seq_len * self.mla.width * itemsize

    def mla_flops(self) -> float:
        """Absorbed MLA FLOPs: 2 * heads * (576 + 512) per visible (query, key) pair, every pair counted.

        A decode query sees its n keys: 2 * B * heads * n * (576 + 512), issue 12's convention.
        """
        m = self.mla
        pairs = self.new_tokens * self.prefix + self.new_tokens * (self.new_tokens + 1) / 2
        return 2.0 * m.num_heads * (m.width + m.kv_lora_rank) * pairs * self.batch


def _decode(batch: int, ctx: int, page: int) -> Workload:
    return Workload(f"decode {batch}x{ctx} p{page}", "decode", batch, ctx - 1, 1, page)


def prefill_workload(batch: int, tokens: int) -> Workload:
    return Workload(f"prefill {batch}x{tokens}", "prefill", batch, 0, tokens, 1)


def _mla_decode(batch: int, ctx: int, heads: int, page: int, shape: MLAShape | None = None) -> Workload:
    return Workload(f"mla decode {batch}x{ctx} h{heads} p{page}", "decode", batch, ctx - 1, 1, page,
                    shape or MLAShape(heads))


def _mla_extend(batch: int, prefix: int, new: int, heads: int, page: int, shape: MLAShape | None = None) -> Workload:
    return Workload(f"mla extend {batch}x({prefix}+{new}) h{heads} p{page}", "extend", batch, prefix, new, page,
                    shape or MLAShape(heads))


WORKLOADS: list[Workload] = [
    _decode(64, 4096, 1),
    _decode(64, 4096, 16),
    _decode(128, 2048, 16),
    _decode(256, 1024, 1),
    _decode(8, 8192, 1),
    _decode(1, 32768, 1),
    prefill_workload(8, 2048),
    prefill_workload(1, 16384),
    prefill_workload(32, 512),
    Workload("extend 8x(4096+512)", "extend", 8, 4096, 512, 1),
]

# issue 12's targets, against FlashInfer's MLA wrapper (fa3 on Hopper)
MLA_WORKLOADS: list[Workload] = [
    _mla_decode(128, 4096, 128, 1),  # compute-bound
    _mla_decode(64, 8192, 128, 64),
    _mla_decode(128, 4096, 16, 64),  # memory-bound
    _mla_decode(1, 32768, 128, 1),  # long context: splits
    _mla_extend(8, 4096, 512, 128, 1),  # absorbed, over a cached prefix
    _mla_extend(8, 4096, 512, 16, 64),  # DeepSeek-V2-Lite's heads: chunked prefill / radix hits
]

_TINY_MLA = MLAShape(16, kv_lora_rank=32, rope_dim=16, qk_head_dim=48)

# the same shapes scaled down, for a smoke run on the CPU under the Triton interpreter
TINY_WORKLOADS: list[Workload] = [
    _decode(4, 64, 1),
    _decode(2, 96, 16),
    prefill_workload(2, 48),
    Workload("extend 2x(40+24)", "extend", 2, 40, 24, 4),
    _mla_decode(4, 64, 16, 1, _TINY_MLA),
    _mla_decode(2, 96, 16, 16, _TINY_MLA),
    _mla_extend(2, 40, 24, 16, 4, _TINY_MLA),
]


def select(names: list[str] | None, pool: list[Workload]) -> list[Workload]:
    """Workloads whose name contains any of `names` (all MHA ones when None).

    MLA workloads count only when a name mentions "mla", so `--workloads decode` stays the MHA race.
    """
    wants_mla = any("mla" in n for n in names or ())
    pool = [w for w in pool if w.mla is None or wants_mla]
    if not names:
        return list(pool)
    chosen = [w for w in pool if any(n in w.name for n in names)]
    if not chosen:
        raise ValueError(f"no workload matches {names}; known: {', '.join(w.name for w in pool)}")
    return chosen
