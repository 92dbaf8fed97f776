"""Prometheus metrics of the server, written by prometheus_client in its text format.

Latency histograms and token counters are updated in the HTTP process as
requests finish; gauges of the engine's state (requests, KV pages, prefix-cache
hit rate) and the engine's own counters (steps, prefill and decode tokens,
preemptions) are read from the engine process when /metrics is scraped, so
they are never stale. Each server has its own registry (tests run several in
one process). With several API workers (PROMETHEUS_MULTIPROC_DIR set before
prometheus_client is imported), each worker's HTTP-side values go to files
there, and a scrape adds up every worker's.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from attnserve.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


_ENGINE_COUNTERS = {"steps": "Engine steps", "mixed_steps": "Engine steps that prefilled and decoded together",
                    "prefill_tokens": "Prompt tokens prefilled", "decode_tokens": "Tokens decoded",
                    "preemptions": "Requests preempted for lack of KV pages",
                    "finished": "Requests the engine finished", "aborted": "Requests the engine aborted"}


_SPEC_COUNTERS = {"verify_steps": "Speculative verify steps",
                  "draft_tokens": "Draft tokens proposed by speculative decoding",
                  "accepted_tokens": "Draft tokens the target model accepted"}


class EngineState:
    """What the engine process reports, as of the last state read: its requests, KV pages and prefix-cache
    hit rate (gauges), its cumulative counters, and the fixed model and backends (an info metric). A collector
    of its own, so that every API worker reports the one engine once."""

    def __init__(self, model: str, prefill_backend: str, decode_backend: str):
        self.labels = {"model": model, "prefill_backend": prefill_backend, "decode_backend": decode_backend}
        self.state: dict = {}

    def collect(self):
        yield InfoMetricFamily("attnserve:backend", "The model and the resolved attention backends",
                               value=self.labels)
        state = self.state
        if not state:
            return
        yield GaugeMetricFamily("attnserve:num_requests_running", "Requests holding KV pages",
                                value=state["running"])
        yield GaugeMetricFamily("attnserve:num_requests_waiting", "Requests queued for admission",
                                value=state["waiting"])
        pages = GaugeMetricFamily("attnserve:kv_pages", "KV cache pages by state", labels=["state"])
        for key in ("total", "free", "cached", "in_use"):
            pages.add_metric([key], state["kv_cache"][f"pages_{key}"])
        yield pages
        yield GaugeMetricFamily("attnserve:prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / looked up",
                                value=state["prefix_cache"].get("hit_rate", 0.0))
        stats = state.get("stats", {})
        for key, doc in _ENGINE_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"attnserve:engine_{key}", doc, value=stats[key])
        for key, name, doc in (("steps_by_mode", "engine_steps_by_mode", "Engine steps by mode"),
                               ("step_seconds_by_mode", "engine_step_seconds",
                                "Wall seconds of engine steps by mode (idle time between steps in none)")):
            if key in stats:
                family = CounterMetricFamily(f"attnserve:{name}", doc, labels=["mode"])
                for mode, value in sorted(stats[key].items()):
                    family.add_metric([mode], value)
                yield family
        spec = stats.get("speculative")
        if spec:
            for key, doc in _SPEC_COUNTERS.items():
                yield CounterMetricFamily(f"attnserve:spec_{key}", doc, value=spec[key])
            yield GaugeMetricFamily("attnserve:spec_acceptance_rate", "Accepted / proposed draft tokens so far",
                                    value=spec["acceptance_rate"])


class ServerMetrics:
    def __init__(self, model: str, prefill_backend: str, decode_backend: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("attnserve:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("attnserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("attnserve:inter_token_latency_seconds", "Gap between consecutive tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("attnserve:e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("attnserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("attnserve:generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("attnserve:cached_prompt_tokens", "Prompt tokens served by the prefix cache",
                                     registry=r)
        self.requests = Counter("attnserve:requests", "Ended requests by finish reason (stop, length, abort, error)",
                                ["finish_reason"], registry=r)
        self.engine = EngineState(model, prefill_backend, decode_backend)
        multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiprocess_dir is None:
            self.exposed = r
        else:  # what a scrape shows: every worker's files, read at each scrape
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, multiprocess_dir)
        self.exposed.register(self.engine)

    def observe(self, output: RequestOutput) -> None:
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.cached_tokens.inc(output.cached_tokens)
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)
        if output.tpot_s is not None:
            self.tpot.observe(output.tpot_s)
        for gap in output.token_latencies_s:
            self.itl.observe(gap)
        if output.ttft_s is not None:
            self.e2e.observe(output.ttft_s + sum(output.token_latencies_s))

    def ended_without_output(self, reasons: list[str]) -> None:
        """Completions that ended before finishing (aborted, failed), by finish reason."""
        for reason in reasons:
            self.requests.labels(reason).inc()

    def render(self, state: dict) -> bytes:
        """The text exposition: this server's (or every API worker's) HTTP-side metrics and the engine's from
        `state` (the engine process's Engine.state() and its Engine.stats())."""
        self.engine.state = state
        return generate_latest(self.exposed)
