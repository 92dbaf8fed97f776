"""NgramDrafter: prompt lookup. The request's last tokens are matched against its own prompt and output;
what followed an earlier occurrence is proposed as the continuation.

Input-grounded work (editing code, summaries that quote, extraction) repeats long stretches of its
prompt, so the continuation of the longest recent match is often right for several tokens. Matching
is a dict lookup per window size: each request keeps an index from n-gram to where it ended,
extended by the tokens appended since the last call (never rebuilt).

Giving up: a verify step costs more than a decode step (about two on the CPU, where its extra rows
leave the int4 kernel), so drafts pay only when enough of them are accepted. Each request keeps a
running mean of the drafts accepted per verify (halving the weight of older steps); while it is below
`min_gain` the request stops proposing for a while (16 steps, doubling on each further miss, up to
256), then tries once more. A workload where nothing is ever accepted then mostly decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.engine.speculative.draft_tree import DraftTree

FIRST_BACKOFF = 16
MAX_BACKOFF = 256


@dataclass
class _RequestState:
    index: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)  # window -> n-gram -> ends
    indexed: int = 0  # n-grams ending before this position are in `index`
    gain: float | None = None  # running mean of drafts accepted per verify step (None: none verified yet)
    backoff: int = 0  # steps to skip after the latest give-up
    skip: int = 0  # steps left to skip now


class NgramDrafter:
    def __init__(self, num_draft_tokens: int, num_steps: int, topk: int = 1, min_window: int = 2,
                 max_window: int = 12, min_gain: float = 1.0):
        """`num_draft_tokens`: most drafts per proposal; `num_steps`: deepest draft; `topk`: most
        continuations merged into a tree (1: one chain); `min_gain`: the accepted drafts per verify below
        which a request stops proposing for a while."""
        if not 1 <= min_window <= max_window:
            raise ValueError(f"match windows need 1 <= min <= max, got {min_window}..{max_window}")
        if num_draft_tokens < 1 or num_steps < 1 or topk < 1:
            raise ValueError("num_draft_tokens, num_steps and topk must be >= 1")
        self.k = num_draft_tokens
        self.depth = num_steps
        self.topk = topk
        self.windows = range(max_window, min_window - 1, -1)  # longest first
        self.min_gain = min_gain
        self._state: dict[object, _RequestState] = {}

    # ---- Drafter -------------------------------------------------------------------------------------
    def propose(self, req) -> DraftTree | None:
        st = self._state.setdefault(req.rid, _RequestState())
        if st.skip > 0:
            st.skip -= 1
            return None
        seq = req.prompt_ids + req.output_ids
        self._index(st, seq)
        continuations = self._continuations(st, seq)
        if not continuations:
            return None
        if self.topk == 1:
            return DraftTree.chain(continuations[0][: min(self.k, self.depth)])
        return merge(continuations, self.k)

    def observe(self, req, tree: DraftTree, accepted: int) -> None:
        st = self._state.get(req.rid)
        if st is None:
            return
        st.gain = accepted if st.gain is None else (st.gain + accepted) / 2
        if st.gain >= self.min_gain:
            st.backoff = 0
            return
        st.backoff = min(MAX_BACKOFF, st.backoff * 2 if st.backoff else FIRST_BACKOFF)
        st.skip = st.backoff

    def forget(self, rid) -> None:
        self._state.pop(rid, None)

    # ---- matching ------------------------------------------------------------------------------------
    def _index(self, st: _RequestState, seq: list[int]) -> None:
        """Add every n-gram that ends before the last token (its continuation must exist)."""
        end = len(seq) - 1
        for w in self.windows:
            table = st.index.setdefault(w, {})
            for e in range(max(st.indexed, w), end + 1):
                table.setdefault(tuple(seq[e - w : e]), []).append(e)
        st.indexed = max(st.indexed, end + 1)

    def _continuations(self, st: _RequestState, seq: list[int]) -> list[list[int]]:
        """Up to `topk` distinct continuations, best first: longer matches first, then the most recent."""
        n = len(seq)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for w in self.windows:
            if w > n:
                continue
            ends = st.index.get(w, {}).get(tuple(seq[n - w :]))
            if not ends:
                continue
            for e in reversed(ends):
                cont = seq[e : e + self.depth]
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    out.append(cont)
                    if len(out) == self.topk:
                        return out
        return out


def merge(continuations: list[list[int]], max_nodes: int) -> DraftTree:
    """The continuations as one tree, shared prefixes merged, at most `max_nodes` drafts; the first
    continuation is laid out first so that it survives the cap."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> draft index
    for cont in continuations:
        parent = -1
        for tok in cont:
            node = children.get((parent, tok))
            if node is None:
                if len(tokens) == max_nodes:
                    break
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                children[(parent, tok)] = node
            parent = node
    return DraftTree(tuple(tokens), tuple(parents))
