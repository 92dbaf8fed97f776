"""What a verify step runs: each request's last token then its drafts, and the masks a tree needs.

Draft i of a request is stored at slot kv_len + 1 + i and rotated at position kv_len + its depth in the tree.
A step of chains needs no mask (causal attention is a chain's mask); a tree step gets per request
`[q, seq_len]`: the prefix all visible, the drafts their ancestors and themselves (and, when every request
has the same q, the trees' own `[B, q, q]`, what a verify graph takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnserve.engine.speculative.draft_tree import DraftTree, verify_masks


def verify_tokens(last_token: int, prefix: int, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """A request's input ids and positions `[1 + drafts]` each (int64): its last token at position prefix, then
    each draft at prefix + its depth."""
    ids = np.asarray((last_token, *tree.tokens), dtype=np.int64)
    positions = prefix + np.asarray((0, *tree.depths()), dtype=np.int64)
    return ids, positions


@dataclass(frozen=True)
class VerifyMasks:
    custom_mask: np.ndarray | None  # per request its [q, seq_len] bool, flattened in batch order; None: chains
    tree_mask: np.ndarray | None  # [B, q, q] bool when every request has the same q (a verify graph's input)
    spec_topk: int  # the widest branching of any tree (1 for chains)


def verify_masks_of(trees: list[DraftTree], prefix_lens: list[int]) -> VerifyMasks:
    """The masks of a verify step over `trees`, whose requests hold `prefix_lens` tokens before it."""
    if all(t.is_chain for t in trees):
        return VerifyMasks(None, None, 1)
    tree_masks, custom_mask = verify_masks(trees, prefix_lens)
    uniform = len({len(t.tokens) for t in trees}) == 1
    topk = max(max((len(c) for c in t.children()), default=1) for t in trees)
    return VerifyMasks(custom_mask, np.stack(tree_masks) if uniform else None, topk)
