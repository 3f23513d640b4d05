"""The batch queue: up to `pipeline_parallel_size` scheduled batches in flight, so that the
pipeline's stages overlap (vLLM's batch queue, `max_concurrent_batches = pp_size`).

With P stages one batch leaves the last stage per step, and the stages before it should already
hold the next ones. So each `Engine.step()` first fills the queue, then finishes its oldest
batch:

    fill:    while fewer than P batches are in flight and the scheduler finds work:
                 schedule a batch (never a sequence of a batch still in flight)
                 launch it: the executor sends it to every stage (`executor.submit`)
    finish:  the oldest batch: its last stage runs in this process (`SubmittedStep.result`),
             then sample -> scheduler update -> stop checks -> detokenize -> outputs

    P = 2:   step 1: schedule 0, schedule 1, finish 0     stage 0 runs 1 while the last runs 0
             step 2: schedule 2, finish 1                 stage 0 runs 2 while the last runs 1

The batches hold different sequences (scheduler.py: `in_flight`), so a batch never waits for a
token another batch in flight will sample, and the host reads every request's state (grammar,
penalties, logprobs) after that request's previous step was processed, as the synchronous
engine does: each request's outputs are the same. A request aborted or finished while one of
its batches is in flight frees its blocks at once; a later batch that takes them runs after the
earlier one on every stage. After a failed step the batches left in flight still run through
the last stage (`drop`), so that the stages' sends and receives stay paired.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tinypaged.distributed.shm_broadcast import NUM_SLOTS

if TYPE_CHECKING:
    from tinypaged.engine.engine import Engine, _LaunchedStep
    from tinypaged.outputs import RequestOutput


class BatchQueue:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # The workers read the steps from a ring of NUM_SLOTS slots: rank 0 never writes more
        # steps ahead of the slowest worker than it holds.
        self.max_concurrent_batches = min(engine.config.pipeline_parallel_size, NUM_SLOTS)
        engine.scheduler.max_concurrent_batches = self.max_concurrent_batches  # its slots
        self.batches: deque[_LaunchedStep] = deque()
        self.max_in_flight = 0  # the most batches ever in flight at once (tests read it)

    def step(self, finished_only: bool) -> list[RequestOutput]:
        engine = self.engine
        while len(self.batches) < self.max_concurrent_batches:
            out = engine.scheduler.schedule()
            if out.is_empty:
                break
            self.batches.append(engine._launch(out))  # its logits: a SubmittedStep
        self.max_in_flight = max(self.max_in_flight, len(self.batches))
        if not self.batches:
            if engine.requests and not engine.scheduler.has_unfinished():
                raise RuntimeError("requests are pending but the scheduler holds none")
            return []
        step = self.batches.popleft()
        submitted, prompt_rows, reqs = step.pending
        step.pending = (submitted.result(), prompt_rows, reqs)  # [rows, vocab]
        engine._sample_launched(step)
        return engine._process(step, finished_only)

    def drop(self) -> None:
        """After a failed step: run what is left in flight through the last stage (its logits
        dropped; nothing more once the executor itself failed) and forget it."""
        batches, self.batches = self.batches, deque()
        for step in batches:
            try:
                step.pending[0].result()
            except Exception:  # noqa: BLE001 - the executor failed: every later call raises
                break
        self.engine.scheduler.drop_in_flight()
