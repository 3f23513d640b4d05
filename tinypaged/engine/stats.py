"""What the engine counts about its own steps and requests, for the server's /metrics.

    IterationStats    tokens per step with output, counted as vLLM does (a histogram:
                      vLLM's iteration_tokens_total) and preemptions, cumulative since start;
                      read by the metrics collector
    RequestStateStats the times of one request's life (vLLM's RequestOutput.metrics):

        arrival --queue--> first scheduled --prefill--> first token --decode--> last token
                           \\_______________________ inference ______________________/

All times are time.monotonic() seconds in the engine's process.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

# Upper bounds of the tokens-per-step buckets (vLLM uses the CUDA-graph sizes and the budget).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationStats:
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS)))
    num_steps: int = 0  # also the +Inf bucket
    num_tokens: int = 0
    num_preemptions: int = 0

    def observe_step(self, num_tokens: int, num_preempted: int = 0) -> None:
        i = bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)
        if i < len(self.bucket_counts):
            self.bucket_counts[i] += 1
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.num_preemptions += num_preempted

    def observe_outputs(self, grown, tokens, requests) -> None:
        """One engine step's outputs (`grown`: the sequences that got tokens; `tokens`: seq_id ->
        its token, or its list of accepted tokens with speculative decoding; `requests`: the
        engine's request states, before this step's first tokens are stamped), counted as
        vLLM's iteration_tokens_total: one per new token plus the whole prompt (cached part
        included) of each request whose first token this is. A step that output nothing (a
        chunk of a prefill) is not observed, as in vLLM."""
        if not grown:
            return
        firsts = {
            s.request_id: len(r.prompt_token_ids) for s in grown
            if (r := requests.get(s.request_id)) is not None and r.stats.first_token_time is None
        }
        new = sum(len(t) if isinstance(t, list) else 1 for t in map(tokens.get, (
            s.seq_id for s in grown)))
        self.observe_step(new + sum(firsts.values()))


@dataclass
class RequestStateStats:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
