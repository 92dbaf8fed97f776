"""The scheduler tracks requests by identity: two requests that compare equal field by field stay two.

Request is a dataclass, so `==` compares fields; list membership and `list.remove` would
then confuse look-alike requests (and cost a field-by-field compare per element, B^2 a
step). These tests build look-alikes on purpose.
"""

import pytest

from attnserve.engine.request import FinishReason, Request, RequestStatus
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.scheduler import Scheduler, SchedulerConfig
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.pool import ReqToTokenPool


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(), PageAllocator(64), ReqToTokenPool(4, 32))


def _twins() -> tuple[Request, Request]:
    params = SamplingParams(max_new_tokens=4)
    a = Request(rid=7, prompt_ids=[1, 2, 3], params=params, arrival_time=0.0)
    b = Request(rid=7, prompt_ids=[1, 2, 3], params=params, arrival_time=0.0)
    return a, b


def test_finishing_one_of_two_look_alike_requests_removes_that_one():
    sched = _scheduler()
    a, b = _twins()
    assert a is not b
    sched.running = [a, b]
    sched.finish(b, FinishReason.LENGTH)
    assert len(sched.running) == 1 and sched.running[0] is a


def test_preempting_the_second_look_alike_keeps_the_first_running():
    sched = _scheduler()
    a, b = _twins()
    sched.running = [a, b]
    sched.preempt(b)
    assert len(sched.running) == 1 and sched.running[0] is a
    assert sched.waiting[0] is b and b.status is RequestStatus.WAITING


def test_preempting_a_request_that_is_not_running_names_it():
    sched = _scheduler()
    a, b = _twins()
    sched.running = [a]
    with pytest.raises(ValueError, match="request 7 is not running"):
        sched.preempt(b)
    assert sched.running == [a] and not sched.waiting
