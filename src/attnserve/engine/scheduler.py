"""Scheduler: which requests run in the next step, and how many tokens each.

Policy (one step):
1. Every running request that is decoding gets one token. If the pool cannot
   hold their next tokens (after evicting unused cached prefixes), the newest
   running request is preempted: its pages and row are freed and it goes back
   to the front of the queue, to be recomputed from its prompt plus what it
   generated so far. This repeats until the decodes fit.
2. The remaining token budget goes to prefill (schedule_policy.py: up to
   `chunked_prefill_size`, or `max_prefill_tokens` when chunking is off; in a
   step that decodes, what the step budget allows beside its decodes): first
   requests whose prompt is partly computed, then new requests in the order of
   `schedule_policy`, each admitted only if a request row and the pages for its
   chunk are free, keeping back one page per running decode so admission does
   not immediately force a preemption.

Overlap scheduling: the engine may schedule step n+1 while step n still runs, before
n's sampled tokens reach the host. A request sampled in step n then holds a pending
token (`Request.num_pending`): it decodes in step n+1 all the same (the runner reads
the token on the device), unless that token is sure to end it by length. A request
with a pending token is never admitted (its prompt-plus-output is not known yet).

Mixed batches, not alternation: decodes and prefill chunks share one forward
pass (ForwardMode.MIXED). A long prompt then costs running decodes one slower
step per chunk instead of a stall, and with chunking the slowdown is bounded by
the step budget (`SchedulerConfig.step_budget`, schedule_policy.py). Steps
with decodes only run as ForwardMode.DECODE, which is what CUDA graphs capture.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from attnserve.batch import ForwardMode
from attnserve.engine.request import FinishReason, Request, RequestStatus
from attnserve.engine.schedule_policy import (
    OFF,
    SCHEDULE_POLICIES,
    StepBudget,
    order_waiting,
    prefill_token_budget,
)
from attnserve.engine.speculative.draft_tree import DraftTree
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.pool import ReqToTokenPool
from attnserve.kvcache.radix import RadixCache


@dataclass
class SchedulerConfig:
    page_size: int = 1
    chunked_prefill_size: int | None = None  # None or <= 0: no chunking
    max_prefill_tokens: int = 16384  # prefill tokens per step when chunking is off (one prompt may exceed it)
    # prompt tokens a step that decodes may add (with chunking; schedule_policy.StepBudget); None: no limit
    step_budget: StepBudget | None = None
    schedule_policy: str = "fcfs"  # admission order of waiting prompts: fcfs or lpm
    disable_radix_cache: bool = False
    deterministic: bool = False  # decode-only steps run as extend steps (one attention path for every token)

    def __post_init__(self):
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size {self.chunked_prefill_size} is smaller than page_size {self.page_size}"
            )
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.step_budget is None:
            self.step_budget = OFF
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {self.schedule_policy!r}")


@dataclass
class ScheduleBatch:
    """One step's work, in batch order."""

    reqs: list[Request]
    extend_lens: list[int]
    prefix_lens: list[int]  # tokens already in the pool for each request
    sample: list[bool]  # True when this step computes the request's last uncomputed token
    mode: ForwardMode
    num_decodes: int = 0  # reqs[:num_decodes] decode: their input token is their last sampled one
    drafts: list | None = None  # TARGET_VERIFY: each request's DraftTree (extend_len = 1 + its drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class SchedulerCounters:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # tokens computed in extend (including recompute after preemption)
    decode_tokens: int = 0
    mixed_steps: int = 0
    finished: int = 0
    aborted: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, req_pool: ReqToTokenPool):
        self.config = config
        self.page_size = config.page_size
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = None if config.disable_radix_cache else RadixCache(allocator, config.page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._admissions = itertools.count(1)

    # ---- queue ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.check_fits(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Refuse a request that could never run (reads only fixed sizes, so any thread may call it)."""
        ps = self.page_size
        need_tokens = min(len(req.prompt_ids) + req.params.max_new_tokens, self.req_pool.max_context_len)
        if len(req.prompt_ids) >= self.req_pool.max_context_len:
            raise ValueError(
                f"prompt of {len(req.prompt_ids)} tokens does not fit the context length "
                f"{self.req_pool.max_context_len} (it needs room for at least one new token)"
            )
        need_pages = -(-need_tokens // ps)
        if need_pages > self.allocator.total:
            raise ValueError(
                f"request needs {need_pages} KV pages ({need_tokens} tokens) but the pool has only "
                f"{self.allocator.total}; lower max_new_tokens or enlarge the KV pool"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- page accounting --------------------------------------------------------------------
    def available_pages(self) -> int:
        return self.allocator.num_free + (self.tree.evictable_pages() if self.tree else 0)

    def _ensure_free(self, n: int) -> bool:
        """Make `n` pages free, evicting cached prefixes if needed; False if impossible."""
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.num_free >= n

    def _pages_for(self, req: Request, new_tokens: int) -> int:
        """Extra pages `req` needs so that `new_tokens` more tokens fit after its kv_len."""
        return max(0, -(-(req.kv_len + new_tokens) // self.page_size) - len(req.pages))

    def _grow(self, req: Request, new_tokens: int) -> bool:
        """Give `req` the pages for `new_tokens` more tokens; False (nothing taken) when the pool cannot.

        The caller preempts or waits on False: running out of pages is a scheduling decision, never an
        exception out of `schedule`.
        """
        need = self._pages_for(req, new_tokens)
        if need:
            if not self._ensure_free(need):
                return False
            req.pages.extend(self.allocator.alloc(need))
        return True

    def _drop_pages(self, req: Request) -> None:
        """Undo a failed admission: the request holds no page afterwards."""
        self.allocator.free(req.pages)
        req.pages, req.kv_len = [], 0

    def _release(self, req: Request, cache: bool) -> None:
        """Hand back the request's pages and row; with `cache`, keep its computed prefix in the tree."""
        if req.row is None:
            return
        if cache and self.tree is not None and req.kv_len:
            self.tree.insert(req.fill_ids[: req.kv_len], req.pages)
        self.allocator.free(req.pages)
        self.req_pool.free(req.row)
        req.pages, req.row, req.kv_len = [], None, 0

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, in_flight: bool = False) -> ScheduleBatch | None:
        """Pick the next step's work and allocate its pages (None when there is nothing to run).

        `in_flight`: a step is still running; with nothing to schedule, wait for it (its finishing requests
        free pages) rather than preempt.
        """
        batch = self._schedule_once()
        while batch is None and len(self.running) > 1 and not in_flight:
            # running prefills stuck waiting for each other's pages: free the newest so the rest move on
            self.preempt(max(self.running, key=lambda r: r.admit_order))
            batch = self._schedule_once()
        return batch

    def _schedule_once(self) -> ScheduleBatch | None:
        reqs, exts, prefixes, sample = [], [], [], []

        decoding = self._prepare_decodes()
        for r in decoding:
            reqs.append(r)
            exts.append(1)
            prefixes.append(r.kv_len)
            sample.append(True)

        c = self.config
        budget = prefill_token_budget(
            c.chunked_prefill_size, c.max_prefill_tokens, c.step_budget, step_tokens=len(decoding))
        reserve = len(decoding)
        # continue prompts already being prefilled (oldest first), then admit new ones
        in_progress = [r for r in self.running if r.num_pending == 0 and r.is_prefilling]
        for r in sorted(in_progress, key=lambda r: r.admit_order):
            if budget <= 0:
                break
            prefix = r.kv_len
            chunk = self._take_chunk(r, budget, reserve, first=len(reqs) == len(decoding))
            if chunk:
                reqs.append(r)
                exts.append(chunk)
                prefixes.append(prefix)
                sample.append(chunk == r.num_uncomputed)
                budget -= chunk
        if budget > 0:
            order_waiting(self.waiting, c.schedule_policy, self._cached_tokens if self.tree else None)
        while self.waiting and budget > 0 and self.req_pool.num_free > 0:
            r = self.waiting[0]
            if r.num_pending:
                break  # preempted while its last token was in flight: admitted once the token is known
            chunk = self._admit(r, budget, reserve, first=len(reqs) == len(decoding))
            if not chunk:
                break
            self.waiting.popleft()
            reqs.append(r)
            exts.append(chunk)
            prefixes.append(r.kv_len)
            sample.append(chunk == r.num_uncomputed)
            budget -= chunk

        if not reqs:
            return None
        if all(e == 1 for e in exts):
            mode = ForwardMode.DECODE
        elif decoding:
            mode = ForwardMode.MIXED
            self.counters.mixed_steps += 1
        else:
            mode = ForwardMode.EXTEND
        if mode is ForwardMode.DECODE and self.config.deterministic:
            mode = ForwardMode.MIXED if decoding else ForwardMode.EXTEND
        self.counters.steps += 1
        return ScheduleBatch(reqs, exts, prefixes, sample, mode, num_decodes=len(decoding))

    def _prepare_decodes(self) -> list[Request]:
        """Running requests that decode this step, with their pages; preempts the newest until they fit."""
        while True:
            max_ctx = self.req_pool.max_context_len
            decoding = [r for r in self.running if r.num_uncomputed == 1 and r.num_generated
                        and not r.pending_token_ends_it(max_ctx)]
            needs = [self._pages_for(r, 1) for r in decoding]  # 0 or 1 each
            need = sum(needs)
            if need == 0:
                return decoding
            if self._ensure_free(need):
                # one allocation for the whole batch; reversed so each request gets the page a
                # per-request alloc(1) would have given it
                pages = self.allocator.alloc(need)[::-1]
                taken = 0
                for r, n in zip(decoding, needs):
                    if n:
                        r.pages.extend(pages[taken : taken + n])
                        taken += n
                return decoding
            self.preempt(max(self.running, key=lambda r: r.admit_order))

    # ---- speculative verify ---------------------------------------------------------------------
    def schedule_verify(self, propose, num_draft_tokens: int, uniform: bool = False) -> ScheduleBatch | None:
        """A TARGET_VERIFY step over every decoding request: its last token, then its drafts from
        `propose(req)` (at most `num_draft_tokens`). `uniform`: every request gets exactly 1 +
        `num_draft_tokens` tokens (drafts padded, a request without drafts too), so the step's shape depends
        on the batch size alone and a captured graph can replay it; otherwise each request verifies what it
        has. None when no request has drafts, or when their pages or context do not fit: the step then
        decodes as usual. It never preempts: speculation only uses room the pool has."""
        k = num_draft_tokens
        decoding = [r for r in self.running if r.num_uncomputed == 1 and r.num_generated and not r.num_pending]
        if not decoding:
            return None
        trees = [propose(r) for r in decoding]
        if not any(t is not None and len(t) for t in trees):
            return None
        empty = DraftTree((), ())
        trees = [t or empty for t in trees]
        if uniform:
            trees = [t.padded(k, pad_token=r.output_ids[-1]) for r, t in zip(decoding, trees)]
        lens = [1 + len(t) for t in trees]
        if any(r.kv_len + n > self.req_pool.max_context_len for r, n in zip(decoding, lens)):
            return None
        needs = [self._pages_for(r, n) for r, n in zip(decoding, lens)]
        if not self._ensure_free(sum(needs)):
            return None
        pages = self.allocator.alloc(sum(needs))
        taken = 0
        for r, n in zip(decoding, needs):
            r.pages.extend(pages[taken : taken + n])
            taken += n
        self.counters.steps += 1
        return ScheduleBatch(decoding, lens, [r.kv_len for r in decoding], [True] * len(decoding),
                             ForwardMode.TARGET_VERIFY, drafts=trees)

    def settle_verify(self, req: Request, emitted: int) -> None:
        """After a verify step that gave `req` `emitted` tokens: a request still running keeps `req.kv_len`
        computed tokens, and the pages past the one its next token goes to return to the pool (a finished
        one has already handed everything back)."""
        self.counters.decode_tokens += emitted
        keep = -(-(req.kv_len + 1) // self.page_size)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def _cached_tokens(self, req: Request) -> int:
        """Tokens of `req` the radix cache would give it if admitted now (what lpm ranks by)."""
        pages = self.tree.match_prefix(req.fill_ids, max_len=req.seq_len - 1, record=False)
        return len(pages) * self.page_size

    def _take_chunk(self, req: Request, budget: int, reserve: int, first: bool) -> int:
        """Allocate pages for as many of `req`'s uncomputed tokens as budget and pool allow; returns the count."""
        chunking = self.config.chunked_prefill_size is not None
        whole = self._replay_step(req) if self.config.deterministic else req.num_uncomputed
        want = whole
        if chunking or not first:
            want = min(want, budget)
        if want < whole and not chunking:
            return 0  # without chunking a prompt runs whole or waits
        need = self._pages_for(req, want)
        spare = self.allocator.num_free - reserve
        if need > spare and self.tree is not None:
            spare = self.available_pages() - reserve  # walks the tree: only when free pages fall short
        if need > spare:
            if not chunking:
                return 0
            # shrink to the tokens that fit in the pages we can get
            want = min(want, (len(req.pages) + max(spare, 0)) * self.page_size - req.kv_len)
            if want <= 0:
                return 0
        if not self._grow(req, want):
            return 0
        return want

    @staticmethod
    def _replay_step(req: Request) -> int:
        """Deterministic inference: the tokens of `req` its next step computes, as its first run computed them
        (its prompt whole, then one token a step). A request preempted after generating recomputes its
        outputs one a step, so each row meets the attention shapes it met before and rounds the same; all at
        once, its attention would run over other shapes and round differently."""
        prompt_left = len(req.prompt_ids) - req.kv_len
        return prompt_left if prompt_left > 0 else min(1, req.num_uncomputed)

    def _admit(self, req: Request, budget: int, reserve: int, first: bool) -> int:
        """Give a waiting request a row, its cached prefix and the pages of its first chunk.

        Returns the chunk's token count, or 0 with nothing held when it does not fit yet.
        """
        cached: list[int] = []
        if self.tree is not None:
            # the last token is always recomputed: its logits are needed to sample the next one
            cached = self.tree.match_prefix(req.fill_ids, max_len=req.seq_len - 1, record=False)
            self.allocator.share(cached)
        req.pages = list(cached)
        req.kv_len = len(cached) * self.page_size
        try:
            chunk = self._take_chunk(req, budget, reserve, first)
            row = self.req_pool.alloc() if chunk else None
        except BaseException:
            self._drop_pages(req)
            raise
        if not chunk:
            self._drop_pages(req)  # not admitted: the shared prefix goes back too
            return 0
        if self.tree is not None:
            st = self.tree.stats
            st.lookups += 1
            st.lookup_tokens += req.seq_len
            st.hit_tokens += len(cached) * self.page_size
        req.cached_len = len(cached) * self.page_size
        req.row = row
        req.status = RequestStatus.RUNNING
        req.admit_order = next(self._admissions)
        self.running.append(req)
        return chunk

    # ---- after the step ---------------------------------------------------------------------
    def commit(self, batch: ScheduleBatch) -> None:
        """The step ran: its tokens' K/V are in the pool."""
        for r, e, s in zip(batch.reqs, batch.extend_lens, batch.sample):
            r.kv_len += e
            if e == 1 and r.num_generated:
                self.counters.decode_tokens += e
            else:
                self.counters.prefill_tokens += e
            if r.kv_len == len(r.prompt_ids) and self.tree is not None and not r.num_generated:
                # share the prompt with requests arriving while this one decodes
                self.tree.insert(r.prompt_ids, r.pages)

    def _remove_running(self, req: Request) -> bool:
        """Drop `req` from `running` by identity (never field-by-field equality); False if absent."""
        for i, r in enumerate(self.running):
            if r is req:
                del self.running[i]
                return True
        return False

    def finish(self, req: Request, reason: FinishReason, matched=None) -> None:
        req.finish(reason, matched)
        if not self._remove_running(req) and req in self.waiting:
            self.waiting.remove(req)  # preempted while its last token was in flight, and that token ended it
        self._release(req, cache=True)
        self.counters.finished += 1

    def preempt(self, req: Request) -> None:
        if not self._remove_running(req):
            raise ValueError(f"request {req.rid!r} is not running, so it cannot be preempted")
        self._release(req, cache=True)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.counters.preemptions += 1

    def abort(self, rid) -> Request | None:
        """Stop a request wherever it is and free what it holds. Returns it, or None if unknown."""
        for i, r in enumerate(self.waiting):
            if r.rid == rid:
                del self.waiting[i]
                r.finish(FinishReason.ABORT)
                self.counters.aborted += 1
                return r
        for i, r in enumerate(self.running):
            if r.rid == rid:
                del self.running[i]
                self._release(r, cache=False)
                r.finish(FinishReason.ABORT)
                self.counters.aborted += 1
                return r
        return None

    def check_leaks(self) -> None:
        """With nothing running, every page is free or held by the prefix cache alone."""
        self.allocator.check_leaks()
        if self.running:
            return
        cached = self.tree.num_pages if self.tree else 0
        if self.allocator.num_used != cached:
            raise AssertionError(f"page leak: {self.allocator.num_used} pages in use, the prefix cache holds {cached}")
