"""The collector guard around CUDA graph captures (attnserve.graph_capture).

A dead object in a reference cycle that owns a CUDA graph must be freed before a capture starts and never
during it: destroying a graph while another is being captured invalidates that capture. The GPU engine test
that builds four engines in one process (test_engine_gpu_mla) is where the failure showed; here the guard's
contract is checked on any machine.
"""

from __future__ import annotations

import gc

import pytest

from attnserve.graph_capture import collector_paused_for_capture


class _OwnsAGraph:
    """Stands for a dead engine: in a cycle, so only the cyclic collector frees it."""

    freed: list[str] = []

    def __init__(self, name: str):
        self.name = name
        self.me = self  # the cycle

    def __del__(self):
        _OwnsAGraph.freed.append(self.name)


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    _OwnsAGraph.freed.clear()
    yield
    (gc.enable if was else gc.disable)()


def test_dead_cycles_are_freed_before_the_capture_and_none_during_it():
    _OwnsAGraph("old engine")
    assert _OwnsAGraph.freed == []  # only the cyclic collector can free it
    with collector_paused_for_capture():
        assert _OwnsAGraph.freed == ["old engine"]
        assert not gc.isenabled()
        _OwnsAGraph("dies during capture")
        junk = [[i] for i in range(50_000)]  # enough allocations to trigger automatic collections if enabled
        del junk
        assert _OwnsAGraph.freed == ["old engine"]
    assert gc.isenabled()
    gc.collect()
    assert _OwnsAGraph.freed == ["old engine", "dies during capture"]


def test_the_collector_comes_back_after_a_failed_capture():
    with pytest.raises(RuntimeError, match="capture failed"):
        with collector_paused_for_capture():
            raise RuntimeError("capture failed")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    with collector_paused_for_capture():
        assert not gc.isenabled()
    assert not gc.isenabled()
