"""How many prompt tokens a step may take, and in which order waiting prompts are admitted.

Token budget (Sarathi-Serve's stall-free batching). A step that decodes runs as long as its
whole batch: a 64-request decode with an 8,192-token prompt chunk beside it takes as long as
the chunk, and every stream stalls for it. With `max_num_batched_tokens` (vLLM's name) a step
that decodes holds at most that many tokens, its decodes included (SGLang's mixed chunk counts
them the same way), so the step time the streams see stays bounded while prompts are prefilled
a budget's worth at a time. A step with nothing decoding has no stream to stall: it takes the
full `chunked_prefill_size`, which fills the device better and shortens the time to first
token when a burst arrives on an idle server. Without chunked prefill the budget does not
apply (a prompt runs whole or waits, as it always does then).

Policy (`--schedule-policy`, SGLang's names):
- fcfs: arrival order (a preempted request goes back to the front). No prompt waits behind
  later arrivals, so the time to first token stays bounded under any mix of prompts.
- lpm: longest prefix match first, by the tokens the radix cache already holds; prompts that
  share a cached system prompt run together while it is cached. A prompt with no match can wait
  behind a stream of matching ones. Like SGLang, above `LPM_MAX_WAITING` waiting requests the
  prefix lookups cost more than they save, and the order falls back to arrival; with the radix
  cache off there is nothing to match, so lpm is fcfs.
"""

from __future__ import annotations

from collections import deque

SCHEDULE_POLICIES = ("fcfs", "lpm")
LPM_MAX_WAITING = 128


def prefill_token_budget(
    chunked_prefill_size: int | None,
    max_prefill_tokens: int,
    max_num_batched_tokens: int | None,
    step_tokens: int,
) -> int:
    """Prompt tokens the step may add on top of the `step_tokens` its decodes already hold.

    0 when the decodes fill the budget: the prompts wait for a step with room (the config
    check keeps room for at least one prompt token beside a full decode batch)."""
    full = chunked_prefill_size or max_prefill_tokens
    if step_tokens == 0 or max_num_batched_tokens is None or chunked_prefill_size is None:
        return full
    return max(0, min(full, max_num_batched_tokens - step_tokens))


def order_waiting(waiting: deque, policy: str, cached_tokens) -> None:
    """Reorder `waiting` in place for admission; `cached_tokens(req)` is its radix-cache hit in tokens
    (None when there is no cache)."""
    if policy == "fcfs" or cached_tokens is None or len(waiting) < 2:
        return
    if len(waiting) > LPM_MAX_WAITING:
        ranked = sorted(waiting, key=lambda r: r.arrival_time)
    else:  # sorted() is stable: equal keys keep the queue's order
        ranked = sorted(waiting, key=lambda r: (-cached_tokens(r), r.arrival_time))
    waiting.clear()
    waiting.extend(ranked)
