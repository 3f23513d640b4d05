"""The decoder of a pooling model: the same forward, a pooling head instead of the LM head.

    hidden = decoder(input_ids)              # [T, hidden], after the final norm
    head "none":        out = hidden                                   (embeddings)
    head "classifier":  out = hidden @ score.weight^T                  [T, num_labels]
    head "yes_no":      out = hidden @ (lm_head[yes] - lm_head[no])^T  [T, 1]  (Qwen3-Reranker:
                        sigmoid(out) = sigmoid(logit_yes - logit_no))

The runner calls the head as `compute_logits`, on the rows the pooler asks for, so the runner,
its CUDA graphs and the scheduler see an ordinary model. Checkpoint names: an embedding
checkpoint saved from the bare model (Qwen3-Embedding) has no "model." prefix and no lm_head;
a *ForSequenceClassification one has score.weight.
"""

from __future__ import annotations

import torch
from torch import nn

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


def as_pooling_model(base: type[nn.Module], pooler: dict) -> type[nn.Module]:
    """A subclass of the decoder class `base` with the head of `pooler` (config.py)."""
    head = pooler["head"]

    class PoolingModel(base):
        def __init__(self, hf_config, quant_config=None) -> None:
            super().__init__(hf_config, quant_config)
            if head == "classifier":
                self.score = nn.Linear(self.spec.hidden_size, pooler["num_labels"], bias=False)
            if head != "yes_no":
                del self.lm_head  # embeddings and classifiers never read the vocabulary
            else:
                self.register_buffer("yes_no", torch.tensor(pooler["yes_no_token_ids"]),
                                     persistent=False)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            if head == "none":
                return hidden
            if head == "classifier":
                return self.score(hidden)
            no, yes = self.lm_head.weight[self.yes_no]  # [hidden] each
            return hidden @ (yes - no).unsqueeze(1)  # [N, 1]

        def map_name(self, checkpoint_name: str) -> str | None:
            name = checkpoint_name
            if name.startswith("lm_head.") and head != "yes_no":
                return None
            if not name.startswith(_OWN_PREFIXES):
                name = "model." + name
            return super().map_name(name)

    PoolingModel.__name__ = PoolingModel.__qualname__ = f"{base.__name__}AsPooling"
    return PoolingModel
