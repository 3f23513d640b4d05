"""Pipeline parallelism: the decoder's layers cut into `pipeline_parallel_size` stages.

    LLM(model, pipeline_parallel_size=2, tensor_parallel_size=2)   # 4 ranks, vLLM's names

Each stage is tensor_parallel_size ranks holding only its layers' weights and KV cache
(models/pipeline.py cuts the layers as vLLM's get_pp_indices). The executors (executor.py for
processes, ray_executor.py for Ray actors) start tp * pp ranks in one torch.distributed world;
world rank 0 is the engine's own process and runs the last stage, so the logits are sampled
where they are computed and never travel (parallel_state.py numbers the stages from the end).
Every rank receives every step's arrays (positions, slot mapping, block tables: each stage's
attention needs them), and a step flows through the stages:

    stage 0 (first)           stage s                       stage P-1 (last: the engine)
    embed(input_ids)          recv [2, T, hidden] <-- s-1    recv <-- P-2
    its layers                its layers                    its layers, final norm, logits
    send (hidden, residual)   send --> s+1                  sample

Hidden states go point to point (torch.distributed send/recv: gloo on the CPU, NCCL between
GPUs) from each tensor-parallel rank to the same rank of the next stage; their shape [T, hidden]
is known from the step, so nothing but the tensor is sent. Inside a stage the layers'
all-reduces run over that stage's own group.

Micro-batches in flight. With P stages the engine keeps up to P scheduled batches in flight
(vLLM's batch queue, engine/batch_queue.py; at most the 4 slots of the ring that carries the
steps to the workers), each holding different sequences, so that stage s
works on batch i + 1 while stage s + 1 works on batch i. The executors split a step in two:
`submit(scheduled)` builds the arrays and sends them to every worker, whose loop starts the
earlier stages on it at once; `result()` of what it returns runs the last stage here (receive,
layers, logits), the steps in the order they were submitted (`LastStageQueue`). The engine
submits batch i + 1 before it runs batch i's last stage and samples it:

    engine (last stage)    submit 0, submit 1 | last 0, sample | submit 2 | last 1, sample | ...
    stage 0 (worker)       first 0 -> send 0  | first 1 -> send 1 (waits for "last 1")  | first 2

Each stage takes its steps in order and each send pairs with the next stage's receive of the
same step, so plain blocking send/recv are enough over gloo and NCCL; a stage waits in its
send only until the next stage starts that step. A step too big for a slot of the shared-memory
ring goes over each worker's pipe (distributed/shm_broadcast.py), and a worker stuck in a step
that rank 0 has not run yet would never read it: then the queued last stages run first.

Not yet: CUDA graphs (stages run eagerly), async scheduling (off: stage 0 needs the sampled ids),
LoRA and speculative decoding, which are refused with pipeline_parallel_size > 1.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import torch

from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.models.pipeline import is_first_stage, is_last_stage, stage_layers
from tinypaged.worker.input_batch import HostBlockTables, StepInput
from tinypaged.worker.model_runner import ModelRunner


def check_pipeline(config: EngineConfig) -> None:
    """Raise ValueError now (before any worker starts) when this engine cannot be cut into
    config.pipeline_parallel_size stages: features not supported with stages, too few layers,
    heads that do not split over tensor_parallel_size (each stage built on the meta device)."""
    from tinypaged.models.decoder import DecoderForCausalLM
    from tinypaged.models.loader import load_hf_config, resolve_model
    from tinypaged.models.registry import get_model_class

    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    unsupported = [name for name, on in (
        ("enable_lora", config.enable_lora),
        ("speculative_config", config.speculative_config is not None),
        ("runner='pooling'", config.runner == "pooling"),
        ("a GGUF checkpoint", config.quantization == "gguf"
         or str(config.model or "").endswith(".gguf")),
    ) if on]
    if unsupported:
        raise ValueError(f"pipeline_parallel_size={pp} cannot be combined with "
                         f"{', '.join(unsupported)} yet; use tensor_parallel_size instead")
    hf_config = load_hf_config(resolve_model(config.model))
    model_class = get_model_class(hf_config)
    if not issubclass(model_class, DecoderForCausalLM):
        raise ValueError(f"pipeline_parallel_size={pp}: {model_class.__name__} is not built on "
                         "the shared decoder (models/decoder.py), which pipeline stages cut")
    for stage in range(pp):
        with distributed.build_as(0, tp, stage, pp), torch.device("meta"):
            model_class(hf_config)


def runner_class(config: EngineConfig) -> type[ModelRunner]:
    """What each rank runs its steps with: PipelineRunner for a pipeline stage."""
    return PipelineRunner if config.pipeline_parallel_size > 1 else ModelRunner


class PipelineRunner(ModelRunner):
    """A ModelRunner that runs one stage's layers: receives the previous stage's hidden states
    (unless first), sends its own to the next (unless last). Eager: no CUDA graphs."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, free_at_start: int | None = None):
        config = dataclasses.replace(config, enforce_eager=True)
        self._tables: list[HostBlockTables] = []  # empty while profiling and warming up
        super().__init__(config, model, device, dtype, free_at_start)
        # One host copy of the block tables per batch in flight: the batches hold different
        # sequences and take turns, so each copy keeps mostly the same rows (input_batch.py).
        self._tables = [self.block_tables] + [
            HostBlockTables(config.max_num_seqs, self.max_blocks_per_seq)
            for _ in range(config.pipeline_parallel_size - 1)]
        self._num_built = 0

    def build_step(self, scheduled, prompt_logits=None) -> StepInput:
        if self._tables:
            self.block_tables = self._tables[self._num_built % len(self._tables)]
            self._num_built += 1
        return super().build_step(scheduled, prompt_logits)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """The step's logits [S, vocab] on the last stage; an empty [0, vocab] elsewhere."""
        with self.kernels:
            input_ids, positions, md, logits_indices = self._device_inputs(step)
            hidden = stage_forward(self.model, self.dtype, input_ids, positions, md)
            if hidden is None:
                return torch.empty(0, self.model.spec.vocab_size, dtype=self.dtype,
                                   device=self.device)
            return self.model.compute_logits(hidden[logits_indices])


def stage_forward(model: torch.nn.Module, dtype: torch.dtype, input_ids: torch.Tensor,
                  positions: torch.Tensor, attn_metadata) -> torch.Tensor | None:
    """This stage's part of DecoderModel.forward; returns the final hidden states [T, hidden]
    on the last stage, None on the others (their output went to the next stage)."""
    decoder = model.model
    start, end = stage_layers(len(decoder.layers))
    if is_first_stage():
        hidden, residual = decoder.embed(input_ids), None  # [T, hidden]
    else:  # the previous stage's (layer output, running sum), stacked: [2, T, hidden]
        both = torch.empty(2, len(input_ids), model.spec.hidden_size, dtype=dtype,
                           device=input_ids.device)
        hidden, residual = distributed.recv_from_prev_stage(both).unbind(0)
    for layer in decoder.layers[start:end]:
        hidden, residual = layer(positions, hidden, residual, attn_metadata)
    if not is_last_stage():
        distributed.send_to_next_stage(torch.stack((hidden, residual)))
        return None
    return decoder.norm(hidden, residual)[0]


class LastStageQueue:
    """The steps rank 0 has sent to the earlier stages and not yet run through its own (the last)
    stage, oldest first. `run(step)` runs one step's last stage; whichever step's result is asked
    for, every older one runs first (its logits kept), so the stages' sends and receives pair up
    in order."""

    def __init__(self, run: Callable[[StepInput], torch.Tensor]) -> None:
        self.run = run
        self.waiting: deque[SubmittedStep] = deque()

    def add(self, step: StepInput) -> SubmittedStep:
        submitted = SubmittedStep(self, step)
        self.waiting.append(submitted)
        return submitted

    def run_through(self, last: SubmittedStep | None = None) -> None:
        """Run the waiting steps up to `last` (every waiting step when None)."""
        while self.waiting and (last is None or not last.started):
            submitted = self.waiting.popleft()
            submitted.started = True  # a step that fails here is not run again
            submitted.logits = self.run(submitted.step)


class SubmittedStep:
    """A step the earlier stages have (or are working on); `result()` gives its logits [S, vocab]
    once the last stage ran it."""

    def __init__(self, queue: LastStageQueue, step: StepInput) -> None:
        self.queue, self.step = queue, step
        self.started = False
        self.logits: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        self.queue.run_through(self)
        if self.logits is None:
            raise RuntimeError("this step's last stage did not run (an earlier one failed)")
        return self.logits
