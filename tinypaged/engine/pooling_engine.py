"""PoolingEngine: the Engine for pooling models (embeddings, classifiers, rerankers).

Same scheduler, paged KV cache, runner and step loop as generation (engine.py); what differs is
one request's life: it is admitted as a Sequence whose only "sampled token" is the end of its
prefill (PoolingParams.max_tokens == 1), so the scheduler batches many inputs per step, chunks
long ones, and never decodes. Each step:

    launch:  runner -> head outputs of the rows the pooler needs (pooling/pooler.py)
             -> pooled vectors of the inputs whose prefill ended -> the task's finish
             (normalize, dimensions, activation) -> one non-blocking copy to the host
    process: scheduler.update (the prefix cache registers the blocks), finish each sequence
             (its blocks are freed), PoolingRequestOutputs

With async scheduling (CUDA) the next step is launched before this one is processed: a finished
input holds one placeholder "token" that already reaches its max_length, so the next step never
schedules it. `create_engine(config)` picks this class or Engine from the checkpoint
(pooling/config.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tinypaged.config import EngineConfig
from tinypaged.engine.engine import Engine, PromptType
from tinypaged.pooling.config import resolve_runner
from tinypaged.pooling.outputs import PoolingOutput, PoolingRequestOutput
from tinypaged.pooling.params import PoolingParams
from tinypaged.pooling.pooler import Pooler
from tinypaged.scheduler import SchedulerOutput, Sequence


def create_engine(config: EngineConfig) -> Engine:
    """A PoolingEngine for a pooling model (config.runner, resolved here), else an Engine."""
    resolve_runner(config)
    return PoolingEngine(config) if config.runner == "pooling" else Engine(config)


@dataclass
class _PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _PooledStep:
    out: SchedulerOutput
    seqs: list[Sequence]  # the sequences whose prefill ended, in the rows of `host`
    host: list[torch.Tensor]  # their results, on their way to the host
    event: torch.cuda.Event | None
    reads_tokens_on_host: bool = False  # Engine.step: may overlap the next step
    pending: None = None  # Engine.step: nothing left to sample after the launch


class PoolingEngine(Engine):
    def _init(self, config: EngineConfig) -> None:
        super()._init(config)
        self.pooler = Pooler(config.pooler_config)
        self.hidden_size = self.hf_config.hidden_size

    def add_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                    lora_request=None) -> None:
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported with pooling models")
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{self.model_name} is a pooling model (runner='pooling', task "
                f"{self.config.pooler_config['task']!r}): it answers embed / classify / score "
                "requests (/v1/embeddings, /pooling, /classify, /score, /rerank), not text "
                "generation"
            )
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.pooler.check(params, self.hidden_size)
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or (vocab and not 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        seq = Sequence(request_id, ids, params)
        # MEAN and CLS read every prompt row: a cached prefix would skip some.
        seq.skip_prefix_cache = self.pooler.every_row
        self.scheduler.add(seq)
        self.requests[request_id] = _PoolingRequest(request_id, text, ids, params, [seq])

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self.pooler.forget(req.seqs[0].seq_id)
        super().abort_request(request_id)

    def _launch(self, out: SchedulerOutput) -> _PooledStep:
        items = out.scheduled
        self.iteration_stats.observe_step(out.num_batched_tokens, len(out.preempted))
        every = [True] * len(items) if self.pooler.every_row else None
        rows = self.executor.execute(items, every)  # the head's outputs (pooling/model.py)
        pooled = self.pooler.pool(items, rows)  # [S, dim]
        seqs = [it.seq for it in items if it.sample]
        params = [self.requests[s.request_id].params for s in seqs]
        results = self.pooler.finish(pooled, params) if seqs else []
        event = None
        if results and pooled.is_cuda:
            # One copy for the usual batch of alike rows, then a CUDA event to wait on.
            if len({r.shape for r in results}) == 1:
                results = list(torch.stack(results).to("cpu", non_blocking=True))
            else:
                results = [r.to("cpu", non_blocking=True) for r in results]
            event = torch.cuda.Event()
            event.record()
        return _PooledStep(out, seqs, results, event)

    def _process(self, step: _PooledStep, finished_only: bool) -> list[PoolingRequestOutput]:
        if step.event is not None:
            step.event.synchronize()
        self.scheduler.update(step.out, {s.seq_id: 0 for s in step.seqs})
        outputs = []
        for seq, data in zip(step.seqs, step.host):
            req = self.requests.pop(seq.request_id, None)
            if req is None:  # aborted while its step ran
                continue
            self.scheduler.finish(seq, "stop")
            outputs.append(PoolingRequestOutput(
                req.request_id, PoolingOutput(data), req.prompt_token_ids, True, req.prompt,
                seq.num_cached_tokens,
            ))
        return outputs
