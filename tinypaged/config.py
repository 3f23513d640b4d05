"""EngineConfig: every knob of the engine in one validated dataclass.

Names and defaults follow vLLM's `LLM(...)` / `vllm serve` so users can switch without
rewriting code. `LLM`, `AsyncLLM` and the CLI all build one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tinypaged import envs
from tinypaged.quantization.registry import check_quantization

CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, hub id, .gguf file; None = the built-in SmolLM2
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str | None = None  # None = cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory-based sizing when given
    cpu_kv_cache_space: float = 1.0  # GiB of KV cache on the CPU (vLLM: VLLM_CPU_KVCACHE_SPACE)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True = no CUDA graphs
    # CUDA graphs when not enforce_eager (vLLM's compilation_config cudagraph_mode):
    # "FULL_DECODE_ONLY" = full graphs of pure-decode steps; "FULL_AND_PIECEWISE" = those, and
    # steps with prompt tokens replay graphs of the pieces between attentions
    # (worker/piecewise_graphs.py)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # vLLM's default
    # None = the checkpoint's own format; else one of quantization/registry.py's names
    quantization: str | None = None
    # "auto" = the model's dtype; "fp8" / "fp8_e4m3" = an e4m3 KV cache, twice the tokens (vLLM's
    # --kv-cache-dtype; per-tensor scale 1.0, vLLM's default without checkpoint scales)
    kv_cache_dtype: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # layers cut into stages (worker/pipeline.py)
    data_parallel_size: int = 1  # engine processes behind one router (dp/)
    data_parallel_routing: str = "cache_aware"  # cache_aware | least_loaded | round_robin
    distributed_executor_backend: str | None = None  # None/"mp": processes; "ray": Ray actors
    # True = every tensor-parallel all-reduce through NCCL (distributed/custom_all_reduce.py, as in
    # vLLM)
    disable_custom_all_reduce: bool = False
    # Schedule step N+1 while the GPU runs step N (vLLM's name); None = on for CUDA, off on CPU.
    async_scheduling: bool | None = None
    chat_template: str | None = None  # a Jinja template string overriding the model's
    # Sampling defaults: "auto" = the model's generation_config.json, "vllm" = none, or a folder
    generation_config: str = "auto"
    load_format: str = "auto"  # "auto" = the checkpoint; "dummy" = random weights (benchmarks)
    skip_tokenizer_init: bool = False  # token ids in and out only (benchmarks)
    # Who runs the ops: "auto" = Triton on CUDA, torch references on the CPU; "triton" = Triton
    # everywhere (the interpreter on the CPU: slow, for learners); "torch" = the references.
    kernels: str = field(default_factory=lambda: envs.TINYPAGED_KERNELS)
    # "auto" = from the checkpoint; "pooling" = embeddings / scores, no decode (tinypaged/pooling)
    runner: str = "auto"
    pooler_config: dict | None = None  # pooling_type ("LAST"|"MEAN"|"CLS"), normalize
    # torch's intra-op threads; None = $OMP_NUM_THREADS, else the usable cores - 1 (host/threads.py)
    cpu_threads: int | None = None
    # Multi-LoRA (lora/, as vLLM's): GPU slots, largest rank, CPU cache (None = max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's speculative_config dict ({"method": "ngram", "num_speculative_tokens": 4, ...}),
    # validated by spec_decode/config.py; None = no speculative decoding
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"
        ):
            positive(name)
        for name in ("max_model_len", "num_kv_blocks", "cpu_threads"):
            if getattr(self, name) is not None:
                positive(name)
        positive("data_parallel_size")
        positive("pipeline_parallel_size")
        if self.pipeline_parallel_size > 1:  # stage 0 reads each step's real ids
            if self.async_scheduling:
                raise ValueError("pipeline_parallel_size > 1 cannot be combined with "
                                 "async_scheduling=True yet; leave async_scheduling unset")
            self.async_scheduling = False
        if self.data_parallel_routing not in ("cache_aware", "least_loaded", "round_robin"):
            raise ValueError("data_parallel_routing must be cache_aware, least_loaded or "
                             f"round_robin; got {self.data_parallel_routing!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray'; got "
                             f"{self.distributed_executor_backend!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got "
                f"{self.cudagraph_mode!r} (enforce_eager=True turns every graph off)"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_space <= 0:
            raise ValueError(f"cpu_kv_cache_space must be > 0 GiB, got {self.cpu_kv_cache_space}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kernels not in ("auto", "triton", "torch"):
            from_env = envs.TINYPAGED_KERNELS == self.kernels
            source = " (from $TINYPAGED_KERNELS)" if from_env else ""
            raise ValueError(
                f"kernels must be auto, triton or torch; got {self.kernels!r}{source}"
            )
        if self.quantization is not None:
            check_quantization(self.quantization)
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError("kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got "
                             f"{self.kv_cache_dtype!r}")
        for name in ("max_loras", "max_lora_rank"):
            positive(name)
        if self.max_lora_rank > 256 or (self.max_cpu_loras or self.max_loras) < self.max_loras:
            raise ValueError(f"need max_lora_rank <= 256 (got {self.max_lora_rank}) and "
                             f"max_cpu_loras >= max_loras (got {self.max_cpu_loras})")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one in the error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
