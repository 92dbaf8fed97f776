"""Which drafts the target model accepts, and the token it adds after them.

Nodes are numbered over (root + drafts): node 0 is the request's last token, node i + 1 is draft i,
and the verify step's logits row for node j predicts the token after it.

Greedy: walk down from the root while some child's token is the target's argmax at its parent;
the bonus is the argmax after the last accepted node. The emitted tokens are exactly what decoding
one token at a time would give.

Sampling: recursive rejection sampling with point-mass drafts (the drafter is deterministic). At a
node with target distribution p, each child c in turn is accepted with probability p(c); a rejected
child is removed from p (zeroed, renormalised) before the next is tried. If none is accepted the
bonus is drawn from what is left of p; after the last accepted node it is drawn from that node's p.
Every emitted token is then distributed exactly as the target model's sampler would draw it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attnserve.engine.speculative.draft_tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted drafts' indices, root to leaf
    bonus: int  # the target's own token after them

    def tokens(self, tree: DraftTree) -> list[int]:
        """What the request emits: the accepted drafts, then the bonus."""
        return [tree.tokens[i] for i in self.path] + [self.bonus]

    def rows(self) -> list[int]:
        """The logits row (node) each emitted token was chosen at: the root, then each accepted draft."""
        return [0] + [i + 1 for i in self.path]


def accept_greedy(tree: DraftTree, argmax: list[int]) -> Acceptance:
    """`argmax[j]`: the target's greedy token after node j."""
    children = tree.children()
    path: list[int] = []
    node = 0
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, want)
        path.append(nxt)
        node = nxt + 1


def accept_sampled(tree: DraftTree, probs: torch.Tensor, uniform: Callable[[], float],
                   draw: Callable[[torch.Tensor], int]) -> Acceptance:
    """`probs` [n + 1, vocab]: the target's filtered distribution after each node (rows sum to 1).
    `uniform()` returns a float in [0, 1); `draw(p)` samples an index from the distribution p."""
    children = tree.children()
    path: list[int] = []
    node = 0
    while True:
        p = probs[node]
        residual = None
        nxt = None
        for c in children[node]:
            q = p if residual is None else residual
            tok = tree.tokens[c]
            pc = float(q[tok])
            if pc > 0 and uniform() < pc:
                nxt = c
                break
            if pc > 0:
                residual = q.clone()
                residual[tok] = 0
                residual /= residual.sum()
        if nxt is None:
            return Acceptance(path, draw(p if residual is None else residual))
        path.append(nxt)
        node = nxt + 1
