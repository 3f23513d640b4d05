"""Steps in which no sequence has an adapter run no LoRA kernel (TINYPAGED_LORA_SKIP_IDLE).

With enable_lora every adapted linear would add its delta in every step, even when the whole
batch runs the base model: the kernels find no segment with tokens and exit, but each is still
a launch (two or three per linear, four linears a layer) and, overlapped, a fork and a join of
the side stream. vLLM's punica wrapper skips them in that case; so does this engine.

The host knows before the forward whether any token has an adapter (`LoRABatch.prepare`, from
the step's plan, the same on every tensor-parallel rank), so the choice is made there, once a
step, as `LoRABatch.run_lora`: an eager forward's layers skip the LoRA path when it is False
(`LoRALinear.active`). A CUDA graph replays what its capture ran, so each graph (decode,
verification, and every piece of the piecewise graphs) is captured twice, inside
`capturing(batch, True)` and `capturing(batch, False)`, and a replay takes the one whose
flag is the step's (`replay_variant`). Why this of the three ways:

- a device-side exit (the kernels read a flag and return) keeps every launch, which is the cost
  being removed, and the side stream's fork and join with it;
- a graph chosen on the host is right by construction (the flag that chose the kernels at
  capture picks the graph at replay) and gives base-only steps exactly the LoRA-off kernels,
  fused FP8 norm-and-quantize included (quantization/fp8.py fp8_norm_linear). Its code is this
  flag and a loop over `graph_variants` in each capture;
- a separate graph set is the same thing, and what it costs: twice the capture time (decode,
  verification and piecewise), and memory for what a graph keeps. The decode and verification
  graphs keep their outputs, so each bucket holds a second logits buffer [bs, vocab] in the
  model's dtype (sum(buckets) rows in all: 2,191 for max_num_seqs 256, about half a GiB in bf16
  for a 128k vocabulary) and the EAGLE / MTP heads' hidden states where kept; the piecewise
  graphs keep only weak views of theirs (piecewise_graphs.py), so they add only the graphs
  themselves. Intermediates share the one memory pool, as before.

TINYPAGED_LORA_SKIP_IDLE=0 keeps one graph set with the LoRA kernels for every step (on CUDA;
the CPU has no graphs and always skips), for A/B comparisons and to spare that capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tinypaged.lora.layers import LoRABatch


def graph_variants(batch: LoRABatch | None) -> tuple[bool, ...]:
    """The `run_lora` values each CUDA graph is captured for, every value a step can have:
    (False,) without LoRA, (True,) when every step runs the kernels (TINYPAGED_LORA_SKIP_IDLE=0
    on CUDA), else both (the graph with the kernels first)."""
    if batch is None:
        return (False,)
    return (True,) if batch.always_run else (True, False)


@contextlib.contextmanager
def capturing(batch: LoRABatch | None, run_lora: bool) -> Iterator[None]:
    """Forwards inside (a capture and its warm-ups) run the LoRA kernels when run_lora, whatever
    the last step's adapters were; the step's own flag comes back after."""
    if batch is None:
        yield
        return
    saved, batch.run_lora = batch.run_lora, run_lora
    try:
        yield
    finally:
        batch.run_lora = saved


def replay_variant(batch: LoRABatch | None) -> bool:
    """The variant of the graphs a step replays, after `LoRABatch.prepare` ran for it."""
    return batch is not None and batch.run_lora
