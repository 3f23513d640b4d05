"""LoRARequest: which adapter a request runs with, as vLLM's (`vllm.lora.request`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: a name for the adapter (the served model name on the server);
    `lora_int_id`: a positive id that identifies it (equal ids = the same adapter);
    `lora_path`: the folder with adapter_config.json and adapter_model.safetensors."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
