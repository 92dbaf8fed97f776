"""DraftTree: the tokens a drafter proposes for one request, as a tree rooted at its last token.

Storage order is the order the verify step lays the drafts out in the KV pool (slot kv_len + 1 + i
for draft i, after the root at kv_len), so a parent always comes before its children. A chain is
the tree in which each draft's parent is the one before it; causal attention is then exactly the
tree's mask, which is why a verify step of chains passes no custom mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [n] draft tokens in storage order (a parent always before its children)
    parents: tuple[int, ...]  # [n] index of each token's parent among the drafts; -1 = the root
    padding: int = 0  # the last `padding` drafts only fill the step's uniform layout: never accepted

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} draft tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft {i}: parent {p} must be -1 (the root) or an earlier draft")
        if not 0 <= self.padding <= len(self.tokens):
            raise ValueError(f"padding {self.padding} for {len(self.tokens)} drafts")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_real(self) -> int:
        """Drafts that may be accepted (the padding excluded)."""
        return len(self.tokens) - self.padding

    @classmethod
    def chain(cls, tokens) -> DraftTree:
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> tuple[int, ...]:
        """Depth of each draft (the root's children are at depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    def children(self) -> list[list[int]]:
        """For each node of (root + drafts), node 0 the root and node i + 1 draft i: its acceptable
        children's draft indices, in storage order."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents[: self.num_real]):
            out[p + 1].append(i)
        return out

    def tree_mask(self) -> np.ndarray:
        """bool [n + 1, n + 1] over (root + drafts): row i may attend to column j when j is i or one of its
        ancestors (the root is everyone's ancestor)."""
        n = len(self.tokens)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask

    def padded(self, k: int, pad_token: int = 0) -> DraftTree:
        """This tree with exactly `k` drafts, the added ones never acceptable. A chain stays a chain (the
        padding continues it, so causal attention still fits); a tree's padding hangs off the root."""
        n = len(self.tokens)
        if n > k:
            raise ValueError(f"{n} drafts do not fit the step's {k}")
        if n == k:
            return self
        token = self.tokens[-1] if self.tokens else pad_token
        extra = k - n
        parents = tuple(range(n - 1, k - 1)) if self.is_chain else (-1,) * extra
        return DraftTree(self.tokens + (token,) * extra, self.parents + parents, self.padding + extra)


def verify_masks(trees: list[DraftTree], prefix_lens: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """A tree verify step's masks: each tree's own [q, q] bool (q = 1 + its drafts), and per request its
    [q, prefix + q] mask, the prefix all visible, flattened and concatenated in batch order, as
    `ForwardBatch.custom_mask` takes it."""
    tree_masks = [t.tree_mask() for t in trees]
    flat = np.concatenate([np.concatenate([np.ones((len(m), p), dtype=bool), m], axis=1).ravel()  # [q * (p + q)]
                           for p, m in zip(prefix_lens, tree_masks)])
    return tree_masks, flat
