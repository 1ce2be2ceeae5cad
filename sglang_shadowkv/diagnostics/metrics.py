"""Prometheus metrics for `--enable-metrics`, under SGLang's names where SGLang has the metric.

Two sources, so that the scheduler's step loop carries no metric code:
- Request timing lives in the HTTP process: the tokenizer manager sees every output as it arrives,
  so time to first token, inter-token latency, end-to-end latency and the token counters are
  measured where the client's clock is (SGLang's TokenizerMetricsCollector does the same).
- Scheduler state (queue, running requests, pool usage, cache hit rate, ShadowKV's compressed
  state) is read from the scheduler's `server_info` answer when /metrics is scraped, and exposed by
  a collector at that moment: always current, never sampled by a background loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sglang_shadowkv.managers.io_struct import TextOut

# SGLang's default buckets (python/sglang/srt/metrics/collector.py)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
               1800, 2400)


@dataclass
class RequestTiming:
    """One request's clock, from the moment the tokenizer manager took it."""
    start: float
    last_output: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total",
                                         "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted_requests = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", E2E_BUCKETS)
        self._scheduler = SchedulerStateCollector(labels)
        self.registry.register(self._scheduler)

    # ---- request timing (tokenizer manager) ---------------------------------------------------
    def request_started(self) -> RequestTiming:
        return RequestTiming(time.perf_counter())

    def observe_output(self, timing: RequestTiming, out: TextOut) -> None:
        now = time.perf_counter()
        first = timing.last_output is None
        if first:  # the prompt is done: its tokens, and how many of them the cache gave
            self.prompt_tokens.inc(out.meta.get("prompt_tokens", 0))
            self.cached_tokens.inc(out.meta.get("cached_tokens", 0))
        if out.new_ids:
            if first:
                self.ttft.observe(now - timing.start)
            else:  # SGLang spreads a multi-token interval evenly over its tokens
                for _ in out.new_ids:
                    self.itl.observe((now - timing.last_output) / len(out.new_ids))
            self.generation_tokens.inc(len(out.new_ids))
        timing.last_output = now
        if out.finished:
            self.e2e.observe(now - timing.start)
            self.requests.inc()
            if (out.meta.get("finish_reason") or {}).get("type") == "abort":
                self.aborted_requests.inc()

    def observe_abandoned(self) -> None:
        """The request ended before its last output (client gone, server stopping)."""
        self.requests.inc()
        self.aborted_requests.inc()

    # ---- scrape -------------------------------------------------------------------------------
    def render(self, server_info: dict) -> bytes:
        """The Prometheus text exposition, with scheduler state from this server_info answer."""
        self._scheduler.info = server_info
        return generate_latest(self.registry)


class SchedulerStateCollector(Collector):
    """Gauges and counters read from the scheduler's latest server_info at scrape time."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.info: dict | None = None

    def collect(self):
        if self.info is None:
            return
        info, families = self.info, []

        def add(kind, name: str, doc: str, value: float) -> None:
            family = kind(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            families.append(family)

        gauge, counter = partial(add, GaugeMetricFamily), partial(add, CounterMetricFamily)

        mem, stats = info["memory"], info["stats"]
        total_tokens = mem["total_pages"] * mem["page_size"]
        used_tokens = (mem["total_pages"] - mem["free_pages"] - mem["lent_pages"]
                       - mem["evictable_pages"]) * mem["page_size"]
        looked_up = stats["cached_tokens"] + stats["prefill_tokens"]
        gauge("sglang:num_running_reqs", "The number of running requests.", info["running_requests"])
        gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", info["waiting_requests"])
        gauge("sglang:num_used_tokens", "The number of used tokens.", used_tokens)
        gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total_tokens)
        gauge("sglang:token_usage", "The token usage.", used_tokens / total_tokens)
        gauge("sglang:cache_hit_rate", "The prefix cache hit rate (cached / all prompt tokens, since start).",
              stats["cached_tokens"] / looked_up if looked_up else 0.0)
        counter("sglang_shadowkv:dense_prefix_hits", "Requests that found dense cached pages for their prompt.",
                stats.get("dense_prefix_hits", 0))
        counter("sglang_shadowkv:reprefilled_tokens", "Prompt tokens prefilled again after the cache dropped them.",
                stats.get("reprefilled_tokens", 0))
        if "host_total_pages" in mem:  # --enable-hierarchical-cache
            for name, doc in (("host_hit_tokens", "Prompt tokens loaded back from the host tier instead of prefilled."),
                              ("host_loaded_bytes", "Bytes loaded from the host tier into the GPU pool."),
                              ("host_load_ms", "Host milliseconds spent issuing host-tier loads."),
                              ("host_stored_bytes", "Bytes copied from the GPU pool into the host tier."),
                              ("host_evicted_tokens", "Tokens dropped from the host tier (or flushed).")):
                counter(f"sglang_shadowkv:{name}", doc, stats.get(name, 0))
            gauge("sglang_shadowkv:host_used_pages", "Host tier pages in use (documents and write-through copies).",
                  mem["host_total_pages"] - mem["host_free_pages"])
            gauge("sglang_shadowkv:host_total_pages", "Pages the host tier holds.", mem["host_total_pages"])
        skv = info.get("shadowkv")
        if skv is not None:
            pools, tiers, cache = skv["pools"], skv["tiers"], skv["chunk_cache"]
            for name, doc in (("compressed_tokens", "Prompt tokens compressed into ShadowKV segments."),
                              ("compressions", "Segments compressed (at prefill, or demoted from the dense tier)."),
                              ("compressed_prefix_hits", "Requests that reused a compressed cached prefix."),
                              ("compressed_tokens_reused", "Prompt tokens served from compressed cached prefixes."),
                              ("exact_copy_hits", "Requests whose prefill over a compressed cached prefix read "
                               "its exact copies (keys and values as the document's cold prefill had them)."),
                              ("dense_copy_prefills", "Of those, prefills that read the copies loaded into dense "
                               "pages, through the dense attention kernel (as the document's cold prefill did)."),
                              ("demotions", "Dense cached spans demoted to compressed form instead of dropped."),
                              ("demoted_tokens", "Tokens demoted from the dense tier to the compressed one."),
                              ("gpu_value_loads", "Compressed segments whose values were copied into lent GPU pages."),
                              ("gpu_value_drops", "Compressed segments whose GPU values were given back."),
                              ("parked_tokens", "Tokens of compressed segments moved whole to the host tier "
                               "under extreme pressure, instead of dropped."),
                              ("unparked_tokens", "Tokens of parked compressed segments copied back to the GPU "
                               "for a request that matched them."),
                              ("to_host_reload_cheaper", "Long dense documents moved to the host tier under "
                               "pressure: a reload costs less than compressed."),
                              ("compressed_no_room", "Long dense documents compressed under pressure: no host "
                               "tier, or it could not take them."),
                              ("compressed_sparse_cheaper", "Long dense documents compressed under pressure: "
                               "cheaper than a reload."),
                              ("compressed_decode_pays", "Dense documents compressed without pressure: their decode "
                               "rows save more than compressing costs."),
                              ("rows_made_sparse", "Running requests switched from reading a document dense to "
                               "sparse.")):
                counter(f"shadowkv:{name}", doc, skv.get(name, 0))
            counter("shadowkv:chunk_cache_hits", "Selected chunks already in a request's scratch (since start).",
                    cache["hits"])
            counter("shadowkv:chunk_cache_lookups", "Chunks selected by sparse decode steps (since start).",
                    cache["lookups"])
            budget = skv["budget"]  # chunks selected per KV head and step, over every request so far
            selected = HistogramMetricFamily("shadowkv:selected_chunks", "Chunks a sparse decode step selected "
                                             "per layer and KV head (since start).", labels=list(self.labels))
            selected.add_metric(list(self.labels.values()),
                                [(str(le), n) for le, n in zip(*budget["histogram"].values())] +
                                [("+Inf", budget["head_steps"])], budget["mean_chunks"] * budget["head_steps"])
            families.append(selected)
            gauge("shadowkv:chunk_cache_hit_rate",
                  "Share of selected chunks already gathered last step, over the running requests.",
                  skv["running_total"]["chunk_cache_hit_rate"])
            gauge("shadowkv:dense_tier_bytes", "GPU bytes of dense KV pages in the radix cache.",
                  tiers["dense_tree_bytes"])
            gauge("shadowkv:gpu_compressed_bytes", "GPU bytes of compressed state held by live segments.",
                  pools["segment_gpu_bytes"])
            gauge("shadowkv:host_compressed_bytes", "Host bytes of values held by live segments.",
                  pools["segment_host_bytes"])
            gauge("shadowkv:gpu_value_bytes", "GPU bytes of compressed values kept in lent pages (given back on demand).",
                  tiers["compressed_gpu_value_bytes"])
            gauge("shadowkv:segments", "Live compressed segments.", pools["segments"])
            gauge("shadowkv:chunk_slot_usage", "Share of the host value pool's chunk slots in use.",
                  1 - pools["free_chunk_slots"] / pools["chunk_slots"])
        yield from families
