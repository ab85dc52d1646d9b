"""The server's metrics in the Prometheus text format (`GET /metrics`, admin keys only).

One collector reads the live values at scrape time, where they already are: the engine's request records
and counters (`engine.telemetry`, `engine.metrics`), its queues (`engine.queue_depth()`), the result writer's
backlog, each backend's `metrics` (compiles, calls, tokens, the paged sampling engine's counters) and the
persistent compilation cache's hits and misses. Nothing is counted twice. Each app has its own
`CollectorRegistry`, so several apps in one process (tests) do not clash.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tx.engine.engine import Engine
from tx.engine.telemetry import LATENCY_BUCKETS, Histogram
from tx.runtime import compile_cache_stats
from tx.version import __version__

CONTENT_TYPE = CONTENT_TYPE_LATEST

# the paged sampling engine's counters (backend.metrics.sampling) -> (metric name, help); other keys are gauges
SAMPLING_COUNTERS = {
    "prefill_tokens": ("tx_sampling_prefill_tokens", "Prompt tokens prefilled (computed) by the sampling engine"),
    "prefill_tokens_cached": ("tx_sampling_prefix_cache_hit_tokens",
                              "Prompt tokens read from the prefix cache instead of computed"),
    "decode_tokens": ("tx_sampling_decode_tokens", "Tokens decoded by the sampling engine"),
    "decode_forwards": ("tx_sampling_decode_forward_steps",
                        "Decode steps that ran the model's layers (none where every row of a call starts from its "
                        "prompt's prefilled last token)"),
    "calls": ("tx_sampling_calls", "Device calls of the sampling engine"),
    "preempted": ("tx_sampling_preemptions", "Sequences preempted (their KV pages given to others)"),
    "pages_uncached": ("tx_kv_cache_pages_uncached",
                       "KV-cache pages dropped from the prefix cache as their adapter's weights changed"),
}
SAMPLING_GAUGES = {
    "kv_cache_pages": ("tx_kv_cache_pages", "KV-cache pages in the pool"),
    "pages_in_use": ("tx_kv_cache_pages_in_use", "KV-cache pages in use now"),
    "peak_pages": ("tx_kv_cache_peak_pages", "Most KV-cache pages in use at once so far"),
}


def registry(engine: Engine) -> CollectorRegistry:
    """A registry of its own holding the collector of `engine` (not prometheus_client's global one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)


def _histogram(name: str, doc: str, table: dict[str, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["kind"])
    for kind, h in sorted(table.items()):
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), h.counts):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric([kind], buckets, sum_value=h.total)
    return family


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class EngineCollector(Collector):
    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # names are not registered: the registry is this app's own

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        events = dict(engine.metrics)  # a copy: the engine thread adds keys
        finished, latency, waited, tokens = engine.telemetry.counters()

        info = GaugeMetricFamily("tx_info", "The tx server: version and base models served (value 1)",
                                 labels=["version", "base_model", "default"])
        for name in engine.backends:
            info.add_metric([__version__, name, str(name == engine.base_model).lower()], 1)
        yield info
        yield GaugeMetricFamily("tx_engine_up", "1 while the engine thread serves, 0 once it stopped on an error",
                                value=0 if engine.error is not None else 1)

        accepted = CounterMetricFamily("tx_requests_accepted", "Requests accepted into the engine's queue, by kind",
                                       labels=["kind"])
        for key, n in sorted(events.items()):
            if key.startswith("submitted_"):
                accepted.add_metric([key[len("submitted_"):]], n)
        yield accepted
        done = CounterMetricFamily("tx_requests", "Requests finished (result written), by kind and status",
                                   labels=["kind", "status"])
        for (kind, status), n in sorted(finished.items()):
            done.add_metric([kind, status], n)
        yield done
        yield _histogram("tx_request_latency_seconds", "Seconds from a request's acceptance to its result", latency)
        yield _histogram("tx_request_queue_seconds", "Seconds a request waited before its backend call started",
                         waited)
        yield GaugeMetricFamily("tx_requests_open", "Requests accepted whose result is not written yet",
                                value=engine.telemetry.open_requests())

        depth = engine.queue_depth()
        queue = GaugeMetricFamily("tx_queue_depth", "Requests waiting for the engine (training: sequenced ops of "
                                  "every model; samples: sampling requests not yet in a backend) or in a backend "
                                  "(sampling)", labels=["queue"])
        sequences = GaugeMetricFamily("tx_queue_sequences", "Sequences of the sampling requests waiting (samples) "
                                      "and in a backend (sampling)", labels=["queue"])
        for name in ("training", "samples", "sampling"):
            queue.add_metric([name], depth[name])
        sequences.add_metric(["samples"], depth["sample_sequences"])
        sequences.add_metric(["sampling"], depth["sampling_sequences"])
        yield queue
        yield sequences

        counted = CounterMetricFamily("tx_tokens", "Tokens of finished requests: trained (forward_backward input), "
                                      "forward (forward input), prompt (sampling prompts times num_samples), "
                                      "sampled (generated)", labels=["kind"])
        for kind, n in sorted(tokens.items()):
            counted.add_metric([kind], n)
        yield counted

        yield CounterMetricFamily("tx_store_write_errors", "Failed attempts to write results to the store",
                                  value=events.get("store_write_errors", 0))
        yield GaugeMetricFamily("tx_store_pending_writes", "Results the store refused, kept in memory to write again",
                                value=engine.results.pending_writes())
        yield CounterMetricFamily("tx_engine_round_errors", "Engine rounds that raised (e.g. the store went away)",
                                  value=events.get("engine_round_errors", 0))
        counters = CounterMetricFamily("tx_engine_events", "The engine's counters (what /api/v1/metrics calls "
                                       "engine), by name", labels=["event"])
        for key, n in sorted(events.items()):
            counters.add_metric([key], n)
        yield counters

        cache = compile_cache_stats()
        yield CounterMetricFamily("tx_compile_cache_hits", "Programs read from the persistent compilation cache",
                                  value=cache.get("hits", 0))
        yield CounterMetricFamily("tx_compile_cache_misses", "Programs not found in the persistent compilation cache",
                                  value=cache.get("misses", 0))
        yield from self._backends()

    def _backends(self) -> Iterator[Metric]:
        labels = ["base_model", "program"]
        compiles = CounterMetricFamily("tx_backend_compiles", "Traces (compiles) of each jit program", labels=labels)
        calls = CounterMetricFamily("tx_backend_calls", "Calls of each backend program", labels=labels)
        real = CounterMetricFamily("tx_backend_tokens_real", "Tokens of the datums each program ran", labels=labels)
        padded = CounterMetricFamily("tx_backend_tokens_padded", "Tokens of the padded device batches each program "
                                     "ran", labels=labels)
        sampling: dict[str, Metric] = {}
        for base, backend in self.engine.backends.items():
            metrics = getattr(backend, "metrics", None)
            if metrics is None:
                continue
            for family, values in ((compiles, metrics.compiles), (calls, metrics.calls),
                                   (real, metrics.tokens_real), (padded, metrics.tokens_padded)):
                for program, n in sorted(dict(values).items()):
                    family.add_metric([base, program], n)
            for key, n in sorted(dict(metrics.sampling).items()):
                if key in SAMPLING_COUNTERS:
                    name, doc = SAMPLING_COUNTERS[key]
                    make = CounterMetricFamily
                else:
                    name, doc = SAMPLING_GAUGES.get(key, (f"tx_sampling_{_sanitize(key)}",
                                                          f"The sampling engine's {key!r}"))
                    make = GaugeMetricFamily
                if name not in sampling:
                    sampling[name] = make(name, doc, labels=["base_model"])
                sampling[name].add_metric([base], n)
        yield from (compiles, calls, real, padded, *sampling.values())
