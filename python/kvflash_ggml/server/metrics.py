"""/metrics in Prometheus text format (prometheus_client), and one structured (JSON) log line per request.

Counters are counted as requests end; the slot gauges are read at scrape time from what each slot's
engine reported after its last request, so a scrape never waits for a prompt that is being computed."""
from __future__ import annotations

import json
import logging
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .scheduler import Scheduler

request_log = logging.getLogger("kvflash_ggml.server.requests")


class SlotCollector(Collector):
    """Per-slot figures from the scheduler's slots."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator:
        slots = self.scheduler.slots
        figures = [  # (family, name, help, the key of the slot's stats)
            (GaugeMetricFamily, "pool_bytes", "device bytes of the slot's KV pool", "device_kv_bytes"),
            (GaugeMetricFamily, "tokens", "tokens the slot's session holds", "tokens"),
            (GaugeMetricFamily, "host_kv_bytes", "bytes of the slot's K/V paged out to host memory", "host_kv_bytes"),
            (CounterMetricFamily, "page_ins", "chunks paged into the slot's pool", "page_ins"),
            (CounterMetricFamily, "page_outs", "chunks paged out of the slot's pool", "page_outs"),
            (CounterMetricFamily, "paged_bytes", "bytes moved between the slot's pool and host memory", "bytes_moved"),
        ]
        for family, name, doc, key in figures:
            metric = family(f"kvflash_slot_{name}", doc, labels=["slot"])
            for s in slots:
                metric.add_metric([str(s.id)], float(s.stats.get(key, 0)))
            yield metric
        busy = GaugeMetricFamily("kvflash_slot_busy", "1 while the slot serves a request", labels=["slot"])
        for s in slots:
            busy.add_metric([str(s.id)], float(s.busy))
        yield busy
        yield GaugeMetricFamily("kvflash_queue_length", "requests waiting for a slot",
                                value=float(self.scheduler.queue_length))
        sched = self.scheduler
        yield CounterMetricFamily("kvflash_batched_steps", "batched decode forwards (several slots' tokens in one)",
                                  value=float(sched.n_batched_steps))
        yield CounterMetricFamily("kvflash_batched_tokens", "tokens decoded by batched forwards",
                                  value=float(sched.n_batched_tokens))
        yield GaugeMetricFamily("kvflash_batch_compute_bytes", "device bytes of the batched decode graphs' buffer",
                                value=float(sched.batch_compute_bytes))


class Metrics:
    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvflash_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("kvflash_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.reused_tokens = Counter("kvflash_prompt_tokens_reused",
                                     "prompt tokens whose K/V a slot held or restored from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("kvflash_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("kvflash_cancelled_requests", "generations cancelled (the client left)", registry=r)
        self.queue_seconds = Histogram("kvflash_queue_seconds", "time from arrival to a free slot", registry=r)
        self.first_token_seconds = Histogram("kvflash_first_token_seconds", "time from a slot to the first token",
                                             registry=r)
        self.up = Gauge("kvflash_slots", "slots (sessions, each with its own pool)", registry=r)
        self.up.set(len(scheduler.slots))
        r.register(SlotCollector(scheduler))


def log_request(**fields: object) -> None:
    request_log.info(json.dumps(fields, separators=(",", ":"), default=str))
