"""Scheduler page accounting without a model: running out of pages is a decision, never an exception."""

from collections import Counter

from attnserve.engine.request import FinishReason, Request, RequestStatus
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.scheduler import Scheduler, SchedulerConfig
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.pool import ReqToTokenPool


def _scheduler(num_pages: int) -> Scheduler:
    return Scheduler(SchedulerConfig(page_size=1), PageAllocator(num_pages), ReqToTokenPool(8, 64))


def _request(rid: int, prompt: list[int], max_new: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def _check_references(sched: Scheduler) -> None:
    """Every page's reference count is exactly the tree's hold plus the running requests' holds."""
    expected = Counter()
    stack = list(sched.tree.root.children.values())
    while stack:
        node = stack.pop()
        expected.update(node.pages)
        stack.extend(node.children.values())
    for r in sched.running:
        expected.update(r.pages)
    for r in sched.waiting:
        assert r.pages == [] and r.row is None, f"waiting request {r.rid} holds pages {r.pages}"
    actual = {p: int(c) for p, c in enumerate(sched.allocator.refcount) if c}
    assert actual == dict(expected)
    sched.allocator.check_leaks()


def _step(sched: Scheduler) -> None:
    """What Engine.step does around the model: schedule, commit, append a sampled token, finish."""
    batch = sched.schedule()
    assert batch is not None
    sched.commit(batch)
    for r, sampled in zip(batch.reqs, batch.sample):
        if sampled:
            r.output_ids.append(7)
            if len(r.output_ids) >= r.params.max_new_tokens:
                sched.finish(r, FinishReason.LENGTH)


def test_unused_prefix_above_a_running_leaf_is_not_counted_as_free():
    sched = _scheduler(21)  # 20 usable pages of one token
    short = _request(0, [1, 2, 3, 4, 10], max_new=1)
    running = _request(1, [1, 2, 3, 4, 20], max_new=6)  # same prefix, admitted in the same step: no hit
    other = _request(2, [90, 91, 92, 93], max_new=1)
    for r in (short, running, other):
        sched.add(r)
    _step(sched)
    # the tree keeps the first request's [1..4] (read by nobody now) above [20], which `running` reads
    assert short.finished and other.finished and running.status is RequestStatus.RUNNING
    assert sched.tree.evictable_pages() == 1 + 4  # [10] and [90..93]; [1..4] cannot go before [20]
    _check_references(sched)

    # shares [90, 91, 92] from the cache and needs 8 more pages: more than eviction can free now
    late = _request(3, [90, 91, 92] + list(range(100, 108)), max_new=2)
    sched.add(late)
    _step(sched)
    assert late.status is RequestStatus.WAITING
    _check_references(sched)

    while sched.has_work():
        _step(sched)
        _check_references(sched)
    assert running.finished and late.finished
    assert late.cached_len == 3  # the shared prefix survived the failed admission
    sched.check_leaks()


def test_a_cache_that_over_promises_makes_requests_wait_not_crash(monkeypatch):
    # the scheduler must not trust the promise blindly: admission fails softly, the prefix goes back
    sched = _scheduler(21)
    running = _request(1, [1, 2, 3, 4, 20], max_new=6)
    cached = _request(2, [90, 91, 92, 93], max_new=1)
    sched.add(running)
    sched.add(cached)
    _step(sched)
    monkeypatch.setattr(sched.tree, "evictable_pages", lambda: 10**6)
    late = _request(3, [90, 91, 92] + list(range(100, 112)), max_new=2)
    sched.add(late)
    _step(sched)  # the old scheduler raised KVCacheExhausted here, leaking the shared [90, 91, 92]
    assert late.status is RequestStatus.WAITING
    _check_references(sched)
    monkeypatch.undo()
    while sched.has_work():
        _step(sched)
        _check_references(sched)
    assert running.finished and late.finished
    sched.check_leaks()


def test_requests_with_equal_fields_are_distinct_in_the_scheduler():
    """Requests compare by identity: membership checks are one pointer compare, and never confuse two."""
    sched = _scheduler(21)
    a, b = _request(0, [1, 2, 3], max_new=2), _request(0, [1, 2, 3], max_new=2)
    b.arrival_time = a.arrival_time  # now every field is equal
    sched.add(a)
    assert a in sched.waiting and b not in sched.waiting
    _step(sched)
    assert a in sched.running and b not in sched.running
    assert a != b and len({a, b}) == 2  # hashable by identity too
