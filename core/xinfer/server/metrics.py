"""Prometheus metrics (``GET /metrics``).

Engine state (running, waiting, KV usage, prefix cache, preemptions) is read from
the engine thread's last snapshot at scrape time; request figures (tokens,
latencies, outcomes) are recorded as each request ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xinfer.engine.async_engine import AsyncEngine, RequestHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        block_size = self.engine.engine.cache.block_size if self.engine.engine is not None else 0
        yield GaugeMetricFamily("xinfer_num_requests_running", "Sequences in the running batch", stats.num_running)
        yield GaugeMetricFamily("xinfer_num_requests_waiting", "Sequences waiting to be scheduled", stats.num_waiting)
        yield GaugeMetricFamily("xinfer_kv_cache_usage", "Share of KV cache blocks in use (0 to 1)", stats.kv_usage)
        yield CounterMetricFamily(
            "xinfer_prefix_cache_queries",
            "Prompt tokens (in full blocks) looked up in the prefix cache",
            stats.prefix_cache_queries * block_size,
        )
        yield CounterMetricFamily(
            "xinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits * block_size
        )
        yield CounterMetricFamily("xinfer_num_preemptions", "Sequences preempted for KV space", stats.num_preemptions)
        yield CounterMetricFamily("xinfer_steps", "Engine steps launched", stats.num_steps)
        yield CounterMetricFamily(
            "xinfer_step_sequences",
            "Sequences in the steps, summed (over xinfer_steps: the mean batch)",
            stats.num_step_sequences,
        )
        yield CounterMetricFamily(
            "xinfer_step_tokens", "Tokens the steps computed, prompt and generated", stats.num_step_tokens
        )
        healthy, _ = self.engine.health()
        yield GaugeMetricFamily("xinfer_engine_healthy", "1 when the engine loop is ready and stepping", int(healthy))


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine))
        counter, histogram = partial(Counter, registry=self.registry), partial(Histogram, registry=self.registry)
        self.prompt_tokens = counter("xinfer_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("xinfer_generation_tokens", "Generated tokens")
        self.finished = counter("xinfer_requests_finished", "Requests ended, by finish reason", ["finish_reason"])
        self.rejected = counter("xinfer_requests_rejected", "Requests refused, by reason", ["reason"])
        latency = partial(histogram, buckets=LATENCY_BUCKETS)
        self.ttft = latency("xinfer_time_to_first_token_seconds", "Arrival to first token")
        self.itl = latency("xinfer_inter_token_latency_seconds", "Time between tokens of a choice")
        self.e2e = histogram("xinfer_e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS)

    def request_done(self, handle: RequestHandle) -> None:
        self.prompt_tokens.inc(handle.num_prompt_tokens)
        self.generation_tokens.inc(handle.num_generated)
        for choice in handle.choices:
            self.finished.labels(choice.finish_reason or "abort").inc()
        if handle.first_token_time is not None:
            self.ttft.observe(handle.first_token_time - handle.arrival)
        for latency in handle.inter_token_latencies:
            self.itl.observe(latency)
        self.e2e.observe(time.monotonic() - handle.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
