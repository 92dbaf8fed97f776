"""EngineLoop: requests from several threads, streamed back; aborts from another thread free pages."""

import threading

import pytest
from engine_helpers import make_engine, prompts

from attnserve.engine.loop import EngineLoop
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(6, seed=31)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
WAIT_S = 60.0  # far beyond what any wait here needs; a lost request fails the test instead of hanging CI


def within(fn, seconds: float = WAIT_S):
    """fn() in a helper thread: its result, or its exception re-raised; fails the test if it is still blocked."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s: a request was lost"
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def join_all(threads, seconds: float = WAIT_S) -> None:
    for t in threads:
        t.join(seconds)
        assert not t.is_alive(), f"{t.name} still running after {seconds} s: a request was lost"


def test_threads_get_the_same_tokens_as_one_at_a_time():
    ref = []
    for p in PROMPTS:
        e = make_engine(disable_radix_cache=True)
        r = e.add_request(p, PARAMS)
        e.run_until_done()
        ref.append(r.output_ids)
    loop = EngineLoop(make_engine()).start()
    results = [None] * len(PROMPTS)

    def client(i):
        h = loop.submit(PROMPTS[i], PARAMS)
        streamed = []
        for ev in h:
            streamed += ev.token_ids
            last = ev
        assert last.finished and last.output.token_ids == streamed
        results[i] = streamed

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    join_all(threads)
    loop.stop()
    assert results == ref
    assert loop.error is None and loop.engine.pages_leaked() == 0


def test_abort_from_another_thread_and_bad_input():
    loop = EngineLoop(make_engine(disable_radix_cache=True)).start()
    h = loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=500, ignore_eos=True))
    events = iter(h)
    first = within(lambda: next(events))  # generating now
    assert first.token_ids
    loop.abort(h.rid)
    rest = within(lambda: list(events))  # ends without a finished output
    assert not any(ev.finished for ev in rest)
    bad = loop.submit([], PARAMS)
    with pytest.raises(ValueError, match="no tokens"):
        within(lambda: list(bad))
    loop.stop()
    assert loop.engine.scheduler.allocator.num_free == loop.engine.scheduler.allocator.total


class _FailingEngine:
    """Accepts requests; its step raises once `fail` is set (the model failing mid-batch)."""

    def __init__(self):
        self.pending: list[int] = []
        self.in_step = threading.Event()
        self.fail = threading.Event()

    def add_request(self, prompt, params, rid):
        self.pending.append(rid)

    def has_work(self):
        return bool(self.pending)

    def step(self):
        self.in_step.set()
        self.fail.wait(10)
        raise RuntimeError("model exploded")

    def abort(self, rid):
        return None


def test_dead_loop_wakes_waiters_and_refuses_new_work():
    engine = _FailingEngine()
    loop = EngineLoop(engine).start()
    running = loop.submit([1, 2, 3], PARAMS)
    assert engine.in_step.wait(10)
    queued = loop.submit([4, 5], PARAMS)  # submitted while the failing step runs: never picked up
    engine.fail.set()
    for handle in (running, queued):
        with pytest.raises(RuntimeError, match="model exploded"):
            within(handle.result, seconds=10.0)  # woken, not left blocked on a dead loop
    join_all([loop._thread], seconds=10.0)
    assert isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="model exploded"):
        loop.submit([6], PARAMS)
    loop.stop()
