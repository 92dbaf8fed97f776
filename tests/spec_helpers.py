"""Drafters with known answers for the speculative-decoding tests.

`OracleDrafter` knows each prompt's greedy continuation (from a run without speculation) and
proposes it, right or deliberately wrong on a fixed schedule, as a chain or as a tree whose right
branch is laid out after a wrong one (so the accepted K/V has to move).
"""

from __future__ import annotations

from engine_helpers import VOCAB

from attnserve.engine.speculative import DraftTree
from attnserve.engine.speculative.ngram import merge


class OracleDrafter:
    def __init__(self, reference: dict[tuple, list[int]], k: int, tree: bool = False, wrong_every: int = 3):
        self.reference = reference  # prompt ids -> greedy output
        self.k = k
        self.tree = tree
        self.wrong_every = wrong_every  # every n-th proposal has a wrong token
        self.calls = 0
        self.observed: list[tuple[int, int]] = []  # (real drafts, accepted) per verify
        self.forgotten: list = []

    def propose(self, req) -> DraftTree | None:
        ref = self.reference[tuple(req.prompt_ids)]
        n = len(req.output_ids)
        right = ref[n : n + self.k]
        if not right:
            return None
        self.calls += 1
        cut = self.calls % self.wrong_every == 0
        if cut:  # a wrong token part-way: what follows it is never accepted
            at = self.calls % len(right)
            right = right[:at] + [(right[at] + 1) % VOCAB] + right[at + 1 :]
        if not self.tree:
            return DraftTree.chain(right)
        decoy = [(right[0] + 7) % VOCAB] + right[1:]
        half = max(1, self.k // 2)
        branches = [decoy[:half], right] if self.calls % 2 else [right, decoy[:half]]
        return merge(branches, self.k)

    def observe(self, req, tree: DraftTree, accepted: int) -> None:
        self.observed.append((tree.num_real, accepted))

    def forget(self, rid) -> None:
        self.forgotten.append(rid)
