"""Prometheus metrics of the server, written by prometheus_client in its text format.

Latency histograms and token counters are updated in the HTTP process as
requests finish; gauges of the engine's state (requests, KV pages, prefix-cache
hit rate) and the engine's own counters (steps, prefill and decode tokens,
preemptions) are read from the engine process when /metrics is scraped, so
they are never stale. Each server has its own registry (tests run several in
one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


class EngineCounters:
    """The engine process's cumulative counters (Engine.stats()), as of the last state read."""

    def __init__(self):
        self.stats: dict = {}

    def collect(self):
        for key, doc in _ENGINE_COUNTERS.items():
            if key in self.stats:
                yield CounterMetricFamily(f"attnserve:engine_{key}", doc, value=self.stats[key])
        spec = self.stats.get("speculative")
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
        self.running = Gauge("attnserve:num_requests_running", "Requests holding KV pages", registry=r)
        self.waiting = Gauge("attnserve:num_requests_waiting", "Requests queued for admission", registry=r)
        self.pages = Gauge("attnserve:kv_pages", "KV cache pages by state", ["state"], registry=r)
        self.hit_rate = Gauge("attnserve:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up",
                              registry=r)
        self.info = Info("attnserve:backend", "The model and the resolved attention backends", registry=r)
        self.info.info({"model": model, "prefill_backend": prefill_backend, "decode_backend": decode_backend})
        self.engine_counters = EngineCounters()
        r.register(self.engine_counters)

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
        """The text exposition, with the gauges and engine counters set from `state` (the engine process's
        Engine.state() and its Engine.stats())."""
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        for key in ("total", "free", "cached", "in_use"):
            self.pages.labels(key).set(state["kv_cache"][f"pages_{key}"])
        self.hit_rate.set(state["prefix_cache"].get("hit_rate", 0.0))
        self.engine_counters.stats = state.get("stats", {})
        return generate_latest(self.registry)
