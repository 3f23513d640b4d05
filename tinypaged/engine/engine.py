"""Engine: one step = schedule -> run the model -> sample -> update, over many requests.

    engine = Engine(EngineConfig(model=...))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():  # RequestOutputs of the requests that moved this step
            ...

A request with n samples becomes n Sequences for the scheduler (they share the prompt's cached
blocks). After each step every sampled sequence gets its token, its text grows through an
incremental detokenizer, and the stop conditions are checked in this order: stop token (eos unless
ignore_eos, or stop_token_ids) -> stop string -> grammar complete (structured output) ->
max_tokens -> max_model_len. A finished sequence's blocks are freed at once.

Logits constraints (structured output, allowed_token_ids, bad_words, logit_bias) are prepared per
request at add_request (sampling/logits_processors.py); each step their masks are built on the CPU
right after the model's launch, so on a GPU they overlap the forward pass.

Async scheduling (`async_scheduling`, on by default on CUDA, as vLLM's). A step is launched
(schedule -> build the batch -> run -> sample, all queued on the GPU) and processed (wait for the
sampled ids on the host -> scheduler update -> stop checks -> detokenize -> outputs) in two
halves. Synchronously each `step()` launches a step and processes it; with async scheduling it
launches step N+1 first and then processes step N while the GPU runs N+1:

    step() call k:   schedule N+1 (placeholders for N's samples) -> launch N+1 -> process N
    GPU:             ... N ][ N+1 ...                 (no gap: N+1 was queued before N ended)

The overlap holds only while nothing in a launch makes the host wait for the GPU (an `.item()`,
a blocking copy, a CUDA tensor indexed with host data): one such wait makes every step wait for
its own forward, and the host work of both halves runs while the GPU idles. On a GPU,
`torch.cuda.set_sync_debug_mode("warn")` around a few steps names each such wait.

A sequence that step N ends (eos, stop string, abort) has one wasted row in step N+1, whose
token is dropped; its blocks are freed when step N is processed (the GPU runs N+1 before any
later step can reuse them). A request whose next sampling reads what the host learns from its
previous token (`samples_from_host_state`: grammar state, output history for penalties and
min_tokens) keeps the overlap by sampling late: step N+1's forward is launched, step N is
processed while it runs (its matchers took N's tokens meanwhile, on the grammar worker's thread:
sampling/grammar_worker.py), and only then are N+1's masks built and its sampling queued. A step
holding a request whose logprobs are read on the host
(`reads_tokens_on_host`) is processed at once, before the next one is scheduled. Either way each
request's outputs are those of the synchronous engine (with speculation: spec_decode/decoder.py).

Pipeline parallelism (`pipeline_parallel_size` P > 1): `step()` is the batch queue's
(engine/batch_queue.py), which keeps up to P batches of different sequences in flight.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinypaged.config import EngineConfig
from tinypaged.engine.batch_queue import BatchQueue
from tinypaged.engine.request_state import (
    RequestState,
    reads_tokens_on_host,
    samples_from_host_state,
)
from tinypaged.engine.stats import IterationStats
from tinypaged.host.threads import apply_cpu_threads
from tinypaged.lora.slots import bind_lora
from tinypaged.outputs import RequestOutput
from tinypaged.sampling.generation_config import default_sampling_params
from tinypaged.sampling.grammar_worker import GrammarAdvance, grammar_verdict
from tinypaged.sampling.logits_processors import (
    LogitsConstraints,
    LogitsMaskBuilder,
    step_sampling_batch,
)
from tinypaged.sampling.params import SamplingParams
from tinypaged.sampling.prompt_logprobs import prompt_rows_wanted, take_prompt_logprobs
from tinypaged.sampling.sampler import Sampler, SamplingBatch, new_generator
from tinypaged.scheduler import Scheduler, SchedulerOutput, Sequence
from tinypaged.worker.executor import create_executor
from tinypaged.worker.model_runner import SampledTokens

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


@dataclass
class _LaunchedStep:
    """A step queued on the device whose sampled tokens are not processed yet."""

    out: SchedulerOutput
    seqs: list[Sequence]  # the sampled sequences, in the rows of `tokens`
    tokens: SampledTokens | None  # None when nothing was sampled
    logprobs: list[dict[int, float] | None]
    reads_tokens_on_host: bool  # processed before the next step is scheduled
    # (logits [rows, V], prompt rows per item, the items' requests) until sampled
    pending: tuple[torch.Tensor, list[int], list[RequestState]] | None = None
    grammar: GrammarAdvance | None = None  # its matchers taking its tokens (grammar_worker.py)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # device_count() asks NVML; is_available() would initialize the CUDA driver here, and a
        # process that did cannot fork tensor-parallel workers (tp_worker.start_method).
        default_device = "cuda" if torch.cuda.device_count() > 0 else "cpu"
        self.device = torch.device(config.device or default_device)
        if self.device.type == "cuda" and self.device.index is None:
            # Not current_device() before CUDA is initialized: it would initialize it.
            index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
            self.device = torch.device("cuda", index)
        if config.async_scheduling is None:  # decided before any rank reads the config
            config.async_scheduling = self.device.type == "cuda"
        apply_cpu_threads(config.cpu_threads, self.device.type)  # torch's intra-op pool
        if config.speculative_config is not None:  # a bad dict fails before the model loads
            from tinypaged.spec_decode.config import SpeculativeConfig
            SpeculativeConfig.from_dict(config.speculative_config)
        # The model on every tensor-parallel rank (worker processes when tensor_parallel_size > 1).
        self.executor = create_executor(config, self.device)
        try:
            self._init(config)
        except BaseException:
            self.executor.shutdown()
            raise

    def _init(self, config: EngineConfig) -> None:
        ex = self.executor
        model, hf_config, model_dir = ex.model, ex.hf_config, ex.model_dir
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = hf_config.vocab_size if hasattr(hf_config, "vocab_size") else None
        config.max_model_len = self._resolve_max_model_len(hf_config)

        self.tokenizer = None
        eos: set[int] = set()
        if not config.skip_tokenizer_init:
            from tinypaged.tokenizer.tokenizer import load_tokenizer, tokenizer_path

            self.tokenizer = load_tokenizer(
                tokenizer_path(config.tokenizer, model_dir), chat_template=config.chat_template
            )
            eos = set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.default_sampling_params = default_sampling_params(
            model_dir if Path(model_dir).is_dir() else None, config.generation_config
        )
        self.vocab_size = model.vocab_size if hasattr(model, "vocab_size") else self.vocab_size
        if self.vocab_size is None and hasattr(model, "spec"):  # e.g. ChatGLM's padded_vocab_size
            self.vocab_size = model.spec.vocab_size

        torch.manual_seed(config.seed)
        if config.speculative_config is not None:  # EAGLE / MTP: the target keeps hidden states
            from tinypaged.spec_decode.head_config import prepare_target
            prepare_target(ex, config)
        self.runner = ex.init_runner()
        self.scheduler = Scheduler(config, self.runner.kv_cache_info.num_blocks)
        self.sampler = Sampler(config.seed)
        self.spec = None  # speculative decoding (spec_decode/decoder.py)
        if config.speculative_config is not None:
            from tinypaged.spec_decode.decoder import SpecDecoder
            self.spec = SpecDecoder(self, config.speculative_config)
        self.mask_builder = LogitsMaskBuilder(self.vocab_size, self.device)
        self._grammar_compiler = None  # built at the first structured-output request
        self.requests: dict[str, RequestState] = {}
        self.iteration_stats = IterationStats()
        self._unscheduled: set[str] = set()  # added, never scheduled yet
        self._host_requests: set[str] = set()  # live requests that reads_tokens_on_host()
        # live requests that samples_from_host_state() -> whether they read token histories
        self._late_requests: dict[str, bool] = {}
        self._in_flight: _LaunchedStep | None = None  # async scheduling: launched, unprocessed
        # pipeline parallelism: up to one batch in flight per stage (batch_queue.py)
        self.batch_queue = BatchQueue(self) if config.pipeline_parallel_size > 1 else None
        self._errors: list[tuple[str, BaseException]] = []
        info = self.runner.kv_cache_info
        logger.debug(  # serve logs the KV cache once, in GiB too
            "model %s on %s (%s); KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB",
            self.model_name, self.device, str(self.dtype).removeprefix("torch."),
            info.num_blocks, info.block_size, info.num_tokens, info.bytes / 2**30,
        )

    def _resolve_max_model_len(self, hf_config) -> int:
        limit = None
        for name in ("max_position_embeddings", "seq_length", "max_sequence_length"):
            if getattr(hf_config, name, None):
                limit = int(getattr(hf_config, name))
                break
        wanted = self.config.max_model_len
        if wanted is None:
            if limit is None:
                raise ValueError(
                    "the model config has no max_position_embeddings; pass max_model_len"
                )
            return limit
        if limit is not None and wanted > limit:
            raise ValueError(
                f"max_model_len={wanted} is larger than the model's max_position_embeddings "
                f"({limit}); pass a value <= {limit}"
            )
        return wanted

    @property
    def kv_cache_info(self) -> dict:
        return self.runner.kv_cache_info.as_dict()

    @property
    def is_dead(self) -> bool:
        """True once a tensor-parallel rank failed: no later step can run."""
        return self.executor.failure is not None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also at garbage collection)."""
        if self.batch_queue is not None:  # a stage waiting to send would not read the stop
            self.batch_queue.drop()
        self.executor.shutdown()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    # ------------------------------------------------------------------ requests

    def _prompt_ids(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the end of the prompt
            ids = ids[-params.truncate_prompt_tokens :]
        return text, ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, token ids or a dict, got {type(prompt).__name__}"
        )

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Everything that could raise later inside a batched step is refused here, one request
        at a time: token ids outside the vocabulary, more logprobs than the vocabulary has."""
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.vocab_size
        bad = [
            t for t in ids if not isinstance(t, int) or (vocab is not None and not 0 <= t < vocab)
        ]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        if vocab is None:
            return
        for name in ("stop_token_ids", "logprob_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= vocab]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is out of range [0, {vocab}) for this model"
                )
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(
                f"logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}"
            )

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request=None) -> None:
        """Queue a request (with a LoRARequest: run by that adapter); raises ValueError now if it
        could never run."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt, params)
        self._check_request(ids, params)
        constraints = LogitsConstraints.build(
            params, self.vocab_size, self.tokenizer, self._get_grammar_compiler
        )
        if self.spec is not None:
            self.spec.check_request(params)
        seqs = [Sequence(request_id, ids, params, index=i) for i in range(params.n)]
        if lora_request is not None:
            bind_lora(self.runner.lora, lora_request, seqs)
        # Prompt logprobs need the logits of every prompt position: no cached prefix.
        seqs[0].skip_prefix_cache = params.prompt_logprobs is not None
        for seq in seqs:
            try:
                self.scheduler.add(seq)
            except Exception:
                self.scheduler.abort(request_id)
                raise
        detoks = [self._detokenizer(ids, params) for _ in seqs]
        generators = [
            new_generator(params.seed + i, self.device) if params.seed is not None else None
            for i in range(params.n)
        ]
        want_lp = params.logprobs is not None
        self.requests[request_id] = RequestState(
            request_id, text, ids, params, seqs, detoks, generators,
            [[] if want_lp else None for _ in seqs], [0.0] * params.n, [None] * params.n,
            [None] if params.prompt_logprobs is not None else None,
            constraints=constraints,
        )
        self._unscheduled.add(request_id)
        if reads_tokens_on_host(params):
            self._host_requests.add(request_id)
        if samples_from_host_state(params, constraints):
            self._late_requests[request_id] = params.uses_penalties or params.min_tokens > 0

    def _get_grammar_compiler(self):
        """Made at the first constrained request, and again if its process died."""
        if self._grammar_compiler is None or not self._grammar_compiler.alive:
            from tinypaged.sampling.grammar_process import start_grammar

            self._grammar_compiler = start_grammar(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self.device,
                self.mask_builder, speculative=self.spec is not None)
        return self._grammar_compiler

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from tinypaged.tokenizer.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params)

    def abort_request(self, request_id: str) -> None:
        """Drop a request at once, freeing its KV blocks; unknown ids are a no-op."""
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        self._unscheduled.discard(request_id)
        self._host_requests.discard(request_id)
        self._late_requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:  # or batches the stages are not through with
        return bool(self.requests) or bool(self.batch_queue and self.batch_queue.batches)

    def get_stats(self) -> dict:
        s = self.scheduler
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "iteration_stats": self.iteration_stats,
            "spec_decode": None if self.spec is None else self.spec.get_stats(),
        }

    def fail_running(self) -> list[str]:
        """After a failed step: abort every request that was scheduled; return their ids."""
        self._in_flight = None
        if self.batch_queue is not None:
            self.batch_queue.drop()
        failed = [
            rid
            for rid, r in self.requests.items()
            if any(s.num_computed_tokens or s.block_table or s.num_output_placeholders
                   for s in r.seqs)
        ]
        for rid in failed:
            self.abort_request(rid)
        return failed

    def pop_request_errors(self) -> list[tuple[str, BaseException]]:
        errors, self._errors = self._errors, []
        return errors

    # ------------------------------------------------------------------ the step

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that moved (only the finished ones
        with `finished_only`, which spares building cumulative outputs every step). With async
        scheduling these are the outputs of the step launched by the previous call."""
        if self.batch_queue is not None:
            return self.batch_queue.step(finished_only)
        outputs: list[RequestOutput] = []
        prev, self._in_flight = self._in_flight, None
        if prev is not None and prev.reads_tokens_on_host:  # read by the next schedule
            outputs += self._process(prev, finished_only)
            prev = None
        if self.spec is not None:  # takes prev's tokens first (spec_decode/decoder.py)
            self.spec.propose(prev)
        out = self.scheduler.schedule()
        launched = None if out.is_empty else self._launch(out)
        if prev is not None:  # while the GPU runs `launched`
            outputs += self._process(prev, finished_only)
        if launched is not None and launched.pending is not None:
            self._sample_launched(launched)  # reads the host state `prev` left
        if launched is None:
            if prev is None and self.requests and not self.scheduler.has_unfinished():
                raise RuntimeError("requests are pending but the scheduler holds none")
        elif self.config.async_scheduling and not launched.reads_tokens_on_host:
            self._in_flight = launched
        else:
            outputs += self._process(launched, finished_only)
        return outputs

    def _launch(self, out: SchedulerOutput) -> _LaunchedStep:
        """Run the model on a scheduled step and sample; the tokens stay on the device."""
        items = out.scheduled
        self.iteration_stats.num_preemptions += len(out.preempted)
        if self._unscheduled:  # requests scheduled for the first time: their queue time ends
            now = time.monotonic()
            for it in items:
                if it.seq.request_id in self._unscheduled:
                    self._unscheduled.discard(it.seq.request_id)
                    self.requests[it.seq.request_id].stats.first_scheduled_time = now
        if self.spec is not None:  # verifies the proposed tokens
            return _LaunchedStep(out, *self.spec.launch(items))
        host = self._host_requests
        on_host = bool(host) and any(it.seq.request_id in host for it in items)
        sampled_items = [it for it in items if it.sample]
        # Only sample 0 of a request with prompt_logprobs (a host request) skips the prefix
        # cache: a cheap test.
        prompt_rows = [
            prompt_rows_wanted(it, self.requests[it.seq.request_id])
            if it.seq.skip_prefix_cache
            else 0
            for it in items
        ] if on_host else [0]
        run = self.executor.execute if self.batch_queue is None else self.executor.submit
        logits = run(  # [rows, vocab], rows in `items` order (submit: a SubmittedStep)
            items, [n > 0 for n in prompt_rows] if any(prompt_rows) else None
        )
        reqs = [self.requests[it.seq.request_id] for it in items]
        step = _LaunchedStep(out, [it.seq for it in sampled_items], None, [], on_host,
                             (logits, prompt_rows, reqs))
        late = self._late_requests
        if self.batch_queue is None and not (self.config.async_scheduling and late
                and any(it.seq.request_id in late for it in sampled_items)):
            self._sample_launched(step)
        return step

    def _sample_launched(self, step: _LaunchedStep) -> None:
        """Sample a launched step's logits, reading the host state as it is now; the tokens
        stay on the device."""
        (logits, prompt_rows, reqs), step.pending = step.pending, None
        items = step.out.scheduled
        try:
            if any(prompt_rows):
                logits = take_prompt_logprobs(items, reqs, prompt_rows, logits)
            sampled_reqs = reqs if len(reqs) == len(step.seqs) else [
                r for r, it in zip(reqs, items) if it.sample]
            sampled, step.logprobs = (
                self._sample(step.seqs, sampled_reqs, logits) if step.seqs else (None, [])
            )
        except BaseException:
            self.executor.keep_sampled(None)  # every rank's collectives stay in step
            raise
        step.tokens = self.executor.keep_sampled(sampled)
        if self.mask_builder.worker is not None and step.tokens is not None:
            step.grammar = self.mask_builder.worker.advance_step(  # while the next one launches
                step.seqs, sampled_reqs, step.tokens)

    def _process(self, step: _LaunchedStep, finished_only: bool) -> list[RequestOutput]:
        """Take a launched step's tokens: scheduler update, stop checks, detokenization; returns
        the outputs of the requests that moved (see `step`)."""
        touched: dict[str, RequestState] = {}
        tokens: dict[int, int] = {}
        lp_by_seq: dict[int, dict[int, float] | None] = {}
        if self.spec is not None:  # its tokens may be applied already (decoder.py: apply)
            grown, tokens, lp_by_seq = self.spec.taken(step)
        else:
            if step.tokens is not None:
                token_ids = self.executor.collect(step.tokens)
                tokens = {seq.seq_id: t for seq, t in zip(step.seqs, token_ids)}
                if any(lp is not None for lp in step.logprobs):
                    lp_by_seq = {seq.seq_id: lp for seq, lp in zip(step.seqs, step.logprobs)}
            grown = self.scheduler.update(step.out, tokens)
        now = time.monotonic()
        self.iteration_stats.observe_outputs(grown, tokens, self.requests)
        deferred = []  # (request, sequence, its stop checks so far): grammar rows (step.grammar)
        for seq in grown:
            req = self.requests.get(seq.request_id)
            if req is None:  # a sibling sample failed this request earlier in the loop
                continue
            touched[req.request_id] = req
            if req.stats.first_token_time is None:
                req.stats.first_token_time = now
            req.stats.last_token_time = now
            try:
                if self.spec is not None:  # several tokens: grammar and stop checks per token
                    self.spec.after_tokens(req, seq, tokens[seq.seq_id],
                                           lp_by_seq.get(seq.seq_id))
                elif step.grammar is not None and req.constraints is not None \
                        and req.constraints.matchers:  # the worker's verdict: read below
                    checks = req.take_token(seq, lp_by_seq.get(seq.seq_id), self.eos_token_ids)
                    deferred.append((req, seq, checks))
                else:
                    self._after_token(req, seq, lp_by_seq.get(seq.seq_id))
            except Exception as exc:  # a fault in one request (e.g. detokenizing) ends only it
                self._fail(req, exc, touched)
        # The grammar rows' verdicts last: the worker's accepts and fills run beside the text.
        for req, seq, (reason, stop_reason) in deferred:
            if self.requests.get(req.request_id) is req:  # no sibling failed it above
                try:
                    self._end_checks(req, seq, reason, stop_reason, None, step.grammar)
                except Exception as exc:
                    self._fail(req, exc, touched)
        outputs = []
        for req in touched.values():
            finished = req.finished
            if finished or not finished_only:
                outputs.append(req.output())
            if finished:
                self.requests.pop(req.request_id, None)
                self._host_requests.discard(req.request_id)
                self._late_requests.pop(req.request_id, None)
        return outputs

    def _sampling_batch(
        self, seqs: list[Sequence], reqs: list[RequestState], device: torch.device
    ) -> SamplingBatch:
        # On a GPU the forward pass is still running: build the grammar masks meanwhile.
        return step_sampling_batch(seqs, reqs, self.mask_builder, self.eos_token_ids, device,
                                   read_histories=any(self._late_requests.values()))

    def _sample(
        self, seqs: list[Sequence], reqs: list[RequestState], logits: torch.Tensor
    ) -> tuple[torch.Tensor, list]:
        """(sampled ids [N] on the device, logprobs or None per row) of `logits` [N, V].

        Admission validates every field, so the batched path should not raise; if it does, the
        rows are sampled one by one and only the requests whose own row raises fail (their row
        holds 0, dropped as the request is gone; the others' tokens come from the retry, which
        may draw fresh randomness for unseeded rows)."""
        try:
            result = self.sampler(logits, self._sampling_batch(seqs, reqs, logits.device))
            return result.sampled, result.logprobs
        except Exception:
            logger.exception("sampling a batch of %d rows failed; retrying row by row", len(seqs))
        rows: list[torch.Tensor] = []
        logprobs: list[dict[int, float] | None] = []
        for i, (seq, req) in enumerate(zip(seqs, reqs)):
            token, lp = torch.zeros(1, dtype=torch.int64, device=logits.device), None
            if seq.request_id in self.requests:  # a sibling sample may have failed it already
                try:
                    batch = self._sampling_batch([seq], [req], logits.device)
                    row = self.sampler(logits[i : i + 1], batch)
                    token, lp = row.sampled, row.logprobs[0]
                except Exception as exc:  # this request alone fails; the step goes on
                    logger.exception("sampling failed for request %s", seq.request_id)
                    self._errors.append((seq.request_id, exc))
                    self.abort_request(seq.request_id)
            rows.append(token)
            logprobs.append(lp)
        return torch.cat(rows), logprobs

    def _fail(self, req: RequestState, exc: Exception, touched: dict) -> None:
        logger.exception("request %s failed", req.request_id)
        self._errors.append((req.request_id, exc))
        self.abort_request(req.request_id)
        touched.pop(req.request_id, None)

    def _after_token(
        self, req: RequestState, seq: Sequence, logprobs: dict[int, float] | None,
        grammar_rejected: bool | None = None, advance: GrammarAdvance | None = None,
    ) -> None:
        reason, stop_reason = req.take_token(seq, logprobs, self.eos_token_ids)
        self._end_checks(req, seq, reason, stop_reason, grammar_rejected, advance)

    def _end_checks(
        self, req: RequestState, seq: Sequence, reason: str | None,
        stop_reason: int | str | None, grammar_rejected: bool | None,
        advance: GrammarAdvance | None,
    ) -> None:
        """The stop checks after RequestState.take_token's: grammar complete, max_tokens,
        max_model_len; finishes the sequence when one holds."""
        token, params = seq.last_token_id, req.params
        if req.constraints is not None and req.constraints.matchers:
            grammar_rejected, ended = grammar_verdict(
                req.constraints.matchers[seq.index], seq.seq_id, token, advance,
                grammar_rejected, reason is None, self.vocab_size, self.eos_token_ids)
            if grammar_rejected:
                raise RuntimeError(f"the grammar rejected sampled token {token}")
            if reason is None and ended:
                reason = "stop"
        if reason is None and params.max_tokens is not None \
                and seq.num_output_tokens >= params.max_tokens:
            reason = "length"
        if reason is None and len(seq) >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            req.stop_reasons[seq.index] = stop_reason
            self.scheduler.finish(seq, reason)
