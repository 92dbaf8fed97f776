"""Speculative decoding: drafts proposed per request, verified by the target model in one step.

The engine talks to a drafter through three calls only (`Drafter`), so any drafter can stand in
for the n-gram one (a benchmark forces drafts of a known acceptance rate this way).
"""

from __future__ import annotations

from typing import Protocol

from attnserve.engine.speculative.draft_tree import DraftTree


class Drafter(Protocol):
    def propose(self, req) -> DraftTree | None:
        """Drafts to verify after `req`'s last token this step (None: nothing worth verifying)."""

    def observe(self, req, tree: DraftTree, accepted: int) -> None:
        """How many of `tree`'s drafts the target accepted (a drafter gives up on requests whose drafts
        keep failing)."""

    def forget(self, rid) -> None:
        """The request ended: drop what the drafter keeps for it."""


def build_drafter(config) -> Drafter | None:
    """The drafter an EngineConfig asks for (None: no speculative decoding)."""
    if config.speculative_algorithm is None:
        return None
    from attnserve.engine.speculative.ngram import NgramDrafter

    k = config.speculative_num_draft_tokens
    return NgramDrafter(k, config.speculative_num_steps or k, config.speculative_eagle_topk,
                        config.speculative_ngram_min_match_window_size,
                        config.speculative_ngram_max_match_window_size)


__all__ = ["DraftTree", "Drafter", "build_drafter"]
