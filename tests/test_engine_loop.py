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
