"""EngineLoop: requests from several threads, streamed back; aborts from another thread free pages."""

import threading

import pytest
from engine_helpers import make_engine, prompts

from attnserve.engine.loop import EngineLoop
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(6, seed=31)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


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

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    loop.stop()
    assert results == ref
    assert loop.error is None and loop.engine.pages_leaked() == 0


def test_abort_from_another_thread_and_bad_input():
    loop = EngineLoop(make_engine(disable_radix_cache=True)).start()
    h = loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=500, ignore_eos=True))
    first = next(iter(h))  # generating now
    assert first.token_ids
    loop.abort(h.rid)
    rest = list(h)  # ends without a finished output
    assert not any(ev.finished for ev in rest)
    bad = loop.submit([], PARAMS)
    with pytest.raises(ValueError, match="no tokens"):
        list(bad)
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


def _result_within(handle, seconds=10.0):
    """handle.result() in a thread: returns ('ok', value) or ('error', exc); fails the test if it hangs."""
    box = []

    def wait():
        try:
            box.append(("ok", handle.result()))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box.append(("error", exc))

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "result() is still blocked after the engine loop died"
    return box[0]


def test_dead_loop_wakes_waiters_and_refuses_new_work():
    engine = _FailingEngine()
    loop = EngineLoop(engine).start()
    running = loop.submit([1, 2, 3], PARAMS)
    assert engine.in_step.wait(10)
    queued = loop.submit([4, 5], PARAMS)  # submitted while the failing step runs: never picked up
    engine.fail.set()
    for handle in (running, queued):
        kind, exc = _result_within(handle)
        assert kind == "error" and "model exploded" in str(exc)
    loop._thread.join(10)
    assert isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="model exploded"):
        loop.submit([6], PARAMS)
    loop.stop()
