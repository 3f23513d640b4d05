"""Which part of the decoder a pipeline stage holds (pipeline parallelism, worker/pipeline.py).

With `pipeline_parallel_size` P the decoder's L layers are cut into P runs of consecutive layers,
as vLLM's get_pp_indices cuts them: L // P each, and the L % P left over go one each to the
stages just before the last one (the last stage also runs the final norm and the LM head):

    L = 10, P = 4:  stage 0: layers 0-1, stage 1: 2-4, stage 2: 5-7, stage 3: 8-9

A stage builds only its own layers; every other layer, the embedding (except on the first
stage, and on the last one when the LM head shares its weight), the final norm and the LM head
(except on the last stage) are `MissingLayer`s: no parameters, no KV cache, and the checkpoint
tensors that belong to them are skipped at load time (`held_elsewhere`).
"""

from __future__ import annotations

from torch import nn

from tinypaged.distributed.parallel_state import get_pp_rank, get_pp_size


class MissingLayer(nn.Module):
    """A module another pipeline stage holds (vLLM's PPMissingLayer)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank` of `pp_size`."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's "
                         f"{num_layers} layers; use at most {num_layers} stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # the remainder, before the last stage
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def stage_layers(num_layers: int) -> tuple[int, int]:
    """This process's stage's [start, end) ((0, num_layers) without pipeline parallelism)."""
    return get_pp_indices(num_layers, get_pp_rank(), get_pp_size())


def is_first_stage() -> bool:
    return get_pp_rank() == 0


def is_last_stage() -> bool:
    return get_pp_rank() == get_pp_size() - 1


def held_elsewhere(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` (e.g. "model.layers.7.mlp.down_proj.weight") belongs to a
    module this stage does not hold."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return False
        if isinstance(module, MissingLayer):
            return True
    return False
