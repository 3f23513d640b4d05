"""LLM: the offline facade. Submit every prompt, step the engine until all are done.

    llm = LLM("path/to/model")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text

Outputs come back in input order whatever order the engine finished them in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tinypaged.config import EngineConfig
from tinypaged.engine.engine import PromptType
from tinypaged.engine.pooling_engine import create_engine
from tinypaged.engine.pooling_llm import PoolingLLMMixin, add_requests
from tinypaged.lora.request import LoRARequest
from tinypaged.outputs import RequestOutput
from tinypaged.sampling.params import SamplingParams

Message = dict[str, Any]


class LLM(PoolingLLMMixin):  # embed / classify / score / encode: engine/pooling_llm.py
    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        if config.data_parallel_size > 1:  # N engine processes behind a router (dp/)
            from tinypaged.dp.offline import DataParallelEngine

            self.engine = DataParallelEngine(config)
        else:
            self.engine = create_engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at garbage collection)."""
        self.engine.shutdown()

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): Counter / Vector objects (spec_decode/metrics.py); today
        the speculative-decoding counters, empty without speculative_config."""
        from tinypaged.spec_decode.metrics import reader_metrics

        stats = self.engine.get_stats().get("spec_decode")
        return reader_metrics(stats, {"model_name": self.engine.model_name})

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: the model's
        generation_config.json sampling defaults (see sampling/generation_config.py), else
        vLLM's."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; returns one RequestOutput per prompt.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (enable_lora)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {len(prompts)} "
                    "prompts; pass one SamplingParams or one per prompt"
                )
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(
            prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries but there are "
                             f"{len(prompts)} prompts; pass one LoRARequest or one per prompt")
        return self._run(prompts, params, use_tqdm, loras)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        As vLLM's: `tools` (OpenAI tool definitions) and `chat_template_kwargs` (e.g.
        {"enable_thinking": False}) are handed to the template; `continue_final_message` leaves
        the last (assistant) message open for the model to continue."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            "chat_template": chat_template,
        }
        prompts = [
            {"prompt_token_ids": self.tokenizer.apply_chat_template(conv, **kwargs)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        order = add_requests(self.engine, self._ids,
                             zip(prompts, params, loras or [None] * len(prompts)))
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, unit="req")
        generated = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                if out.finished:
                    results[order[out.request_id]] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"output: {generated / elapsed:.1f} tok/s", refresh=False)
        bar.close()
        return results  # type: ignore[return-value]
