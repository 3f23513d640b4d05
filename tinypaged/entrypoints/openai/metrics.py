"""Prometheus metrics of the server, measured from the stream of outputs each request sees.

Names follow vLLM's with a `tinypaged:` prefix and a `model_name` label:

    read from engine.get_stats() at scrape time
        tinypaged:num_requests_running, tinypaged:num_requests_waiting,
        tinypaged:kv_cache_usage_perc             fraction of KV blocks in use, 0..1
        tinypaged:num_preemptions_total           sequences preempted (recomputed later)
        tinypaged:iteration_tokens_total          histogram of tokens per step with output, counted
                                                  as vLLM: new tokens + first-token prompts
        tinypaged:cache_config_info               1, with the KV cache's block size and count
    counters
        tinypaged:prompt_tokens_total             counted when a request's first output arrives
        tinypaged:generation_tokens_total         counted as tokens arrive (aborted ones too)
        tinypaged:prefix_cache_queries_total      prompt tokens looked up in the prefix cache
        tinypaged:prefix_cache_hits_total         ... and found there
        tinypaged:request_success_total{finished_reason=stop|length|abort}   one per engine request
                                                  (length if any sample hit it)
    histograms, per finished request
        tinypaged:request_prompt_tokens, tinypaged:request_generation_tokens (all samples),
        tinypaged:request_max_num_generation_tokens (the longest sample),
        tinypaged:request_params_n, tinypaged:request_params_max_tokens
    histograms (seconds)
        tinypaged:time_to_first_token_seconds     submission -> first generated token
        tinypaged:inter_token_latency_seconds     one observation per token after a sample's first
        tinypaged:e2e_request_latency_seconds     submission -> last output, finished requests only
        tinypaged:request_queue_time_seconds      engine arrival -> first scheduled
        tinypaged:request_prefill_time_seconds    first scheduled -> first token
        tinypaged:request_decode_time_seconds     first token -> last token
        tinypaged:request_inference_time_seconds  first scheduled -> last token
        tinypaged:request_time_per_output_token_seconds   decode time / (tokens - 1)

Bookkeeping identities (what the tests check): the TTFT count is the number of requests that got a
token; the inter-token count is generation tokens minus samples that got a token.

Each app gets its own CollectorRegistry, so many apps (tests) can live in one process.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tinypaged.engine.stats import ITERATION_TOKEN_BUCKETS, IterationStats
from tinypaged.outputs import RequestOutput

if TYPE_CHECKING:
    from tinypaged.engine.client import EngineClient

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineGauges:
    """A custom collector: asks the engine for its queue lengths, cache usage and step counts on
    each scrape."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        yield from self._config_info()
        stats = self.engine.get_stats()
        steps = stats.get("iteration_stats")
        if steps is not None:
            yield from self._iterations(steps)
        if stats.get("spec_decode"):
            yield from self._spec_decode(stats["spec_decode"])
        # Data parallelism (dp/): one series per engine, labelled `engine` as vLLM's.
        per_engine = stats.get("per_engine")
        rows = ([([self.model_name], stats)] if per_engine is None else
                [([self.model_name, str(i)], s) for i, s in enumerate(per_engine)])
        names = ["model_name"] if per_engine is None else ["model_name", "engine"]
        for name, key, doc in (
            ("num_requests_running", "num_running", "Requests in the running batch."),
            ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0-1)."),
        ):
            gauge = GaugeMetricFamily(f"tinypaged:{name}", doc, labels=names)
            for values, row in rows:
                gauge.add_metric(values, float(row.get(key, 0)))
            yield gauge

    def _iterations(self, steps: IterationStats):
        labels = [self.model_name]
        preempted = CounterMetricFamily(
            "tinypaged:num_preemptions", "Sequences preempted.", labels=["model_name"]
        )
        preempted.add_metric(labels, steps.num_preemptions)
        yield preempted
        hist = HistogramMetricFamily(
            "tinypaged:iteration_tokens_total", "Tokens per engine step.", labels=["model_name"]
        )
        cumulative = list(itertools.accumulate(steps.bucket_counts))
        buckets = [(str(float(b)), c) for b, c in zip(ITERATION_TOKEN_BUCKETS, cumulative)]
        hist.add_metric(labels, buckets + [("+Inf", steps.num_steps)], steps.num_tokens)
        yield hist

    def _spec_decode(self, spec: dict):
        from tinypaged.spec_decode.metrics import COUNTERS, PER_POS, PREFIX

        for key, doc in COUNTERS:
            counter = CounterMetricFamily(PREFIX + key, doc, labels=["model_name"])
            counter.add_metric([self.model_name], spec[key])
            yield counter
        per_pos = CounterMetricFamily(PREFIX + PER_POS[0], PER_POS[1],
                                      labels=["model_name", "position"])
        for j, n in enumerate(spec[PER_POS[0]]):
            per_pos.add_metric([self.model_name, str(j)], n)
        yield per_pos

    def _config_info(self):
        info = self.engine.kv_cache_info
        gauge = GaugeMetricFamily(
            "tinypaged:cache_config_info",
            "The KV cache's configuration (value 1).",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        gauge.add_metric([self.model_name, str(info["block_size"]), str(info["num_blocks"])], 1)
        yield gauge


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "tinypaged:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "tinypaged:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self.prefix_queries = Counter(
            "tinypaged:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels, registry=reg,
        ).labels(model_name)
        self.prefix_hits = Counter(
            "tinypaged:prefix_cache_hits", "Prompt tokens served by the prefix cache.", labels,
            registry=reg,
        ).labels(model_name)
        self._finished = Counter(
            "tinypaged:request_success",
            "Requests ended, by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"tinypaged:{name}", doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first generated token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive tokens of a sample.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Submission to last token, finished requests.", _E2E_BUCKETS)
        self.per_request = {
            name: histogram(f"request_{name}", doc, buckets)
            for name, doc, buckets in (
                ("prompt_tokens", "Prompt tokens of a request.", _TOKEN_BUCKETS),
                ("generation_tokens", "Tokens generated for a request.", _TOKEN_BUCKETS),
                ("max_num_generation_tokens", "Tokens of a request's longest sample.",
                 _TOKEN_BUCKETS),
                ("params_n", "The n of a request.", _N_BUCKETS),
                ("params_max_tokens", "The max_tokens of a request.", _TOKEN_BUCKETS),
                ("queue_time_seconds", "Arrival to first scheduled.", _PHASE_BUCKETS),
                ("prefill_time_seconds", "First scheduled to first token.", _PHASE_BUCKETS),
                ("decode_time_seconds", "First token to last token.", _PHASE_BUCKETS),
                ("inference_time_seconds", "First scheduled to last token.", _PHASE_BUCKETS),
                ("time_per_output_token_seconds", "Decode time per token after the first.",
                 _TPOT_BUCKETS),
            )
        }
        reg.register(_EngineGauges(engine, model_name))

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, params: Any = None) -> RequestMetrics:
        return RequestMetrics(self, params)


class RequestMetrics:
    """The timing of one engine request, fed every cumulative RequestOutput it yields."""

    def __init__(self, metrics: ServerMetrics, params: Any = None):
        self.m = metrics
        self.params = params  # the SamplingParams, for the request_params_* histograms
        self.start = time.perf_counter()
        self.seen_prompt = False
        self.first_token = False
        self.num_tokens: dict[int, int] = {}  # sample index -> tokens counted so far
        self.last_time: dict[int, float] = {}  # sample index -> when its newest token arrived
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        t = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
            self.m.prefix_queries.inc(len(out.prompt_token_ids))
            self.m.prefix_hits.inc(out.num_cached_tokens)
        for c in out.outputs:
            new = len(c.token_ids) - self.num_tokens.get(c.index, 0)
            if new <= 0:
                continue
            if not self.first_token:
                self.first_token = True
                self.m.ttft.observe(t - self.start)
            self.m.generation_tokens.inc(new)
            if c.index in self.last_time:
                # Several tokens in one output share the gap since this sample's last token.
                gap = (t - self.last_time[c.index]) / new
                for _ in range(new):
                    self.m.itl.observe(gap)
            else:
                for _ in range(new - 1):  # tokens that arrived together with the first
                    self.m.itl.observe(0.0)
            self.num_tokens[c.index] = len(c.token_ids)
            self.last_time[c.index] = t
        if out.finished and not self.done:
            self.done = True
            reasons = {c.finish_reason for c in out.outputs}
            reason = next((r for r in ("abort", "length") if r in reasons), "stop")
            if reason != "abort":
                self.m.e2e.observe(t - self.start)
                self._finished(out)
            self.m.finished(reason)

    def _finished(self, out: RequestOutput) -> None:
        """The per-request histograms of a request that finished."""
        h = self.m.per_request
        lengths = [len(c.token_ids) for c in out.outputs]
        h["prompt_tokens"].observe(len(out.prompt_token_ids))
        h["generation_tokens"].observe(sum(lengths))
        h["max_num_generation_tokens"].observe(max(lengths, default=0))
        if self.params is not None:
            h["params_n"].observe(self.params.n)
            if self.params.max_tokens is not None:
                h["params_max_tokens"].observe(self.params.max_tokens)
        s = out.metrics
        if s is None or None in (s.first_scheduled_time, s.first_token_time, s.last_token_time):
            return
        decode = s.last_token_time - s.first_token_time
        h["queue_time_seconds"].observe(s.first_scheduled_time - s.arrival_time)
        h["prefill_time_seconds"].observe(s.first_token_time - s.first_scheduled_time)
        h["decode_time_seconds"].observe(decode)
        h["inference_time_seconds"].observe(s.last_token_time - s.first_scheduled_time)
        if max(lengths, default=0) > 1:
            h["time_per_output_token_seconds"].observe(decode / (max(lengths) - 1))

    def aborted(self) -> None:
        """The request ended without a final output (client gone, error, shutdown)."""
        if not self.done:
            self.done = True
            self.m.finished("abort")
