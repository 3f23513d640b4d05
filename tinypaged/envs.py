"""Every TINYPAGED_* environment variable, declared once (a small vLLM `vllm/envs.py`).

    from tinypaged import envs
    if envs.TINYPAGED_GC_DEBUG: ...

`ENVIRONMENT_VARIABLES` maps each name to its type, its value when unset, a one-line meaning
and the function that turns the variable's text into that value. README's "Environment
variables" lists the same names (a test holds the two together).

A variable is read when its attribute is looked up, never at import: a value set after
`import tinypaged` (a launcher script, a test's monkeypatch) counts, and a module that reads one
once per step pays one dict lookup. A value that cannot mean anything raises ValueError naming
the variable, the value and what it accepts; the on/off switches stay as lenient as they always
were (only "1" turns GC_DEBUG and PIECEWISE_UNCHECKED on, only "0" turns DENSE_GEMV and
GRAMMAR_THREAD off).
TINYPAGED_KERNELS comes back as written: EngineConfig checks it, as it checks the `kernels=`
argument, so the CLI's `--help` still works with a bad value in the environment.

This module imports nothing from tinypaged, so every layer (kernels included) may read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    type: str  # what the attribute gives, as the README writes it
    default: Any  # the value when the variable is unset
    meaning: str
    parse: Callable[[str, str], Any]  # (name, text as set) -> value


def _is_one(name: str, text: str) -> bool:
    return text == "1"


def _is_not_zero(name: str, text: str) -> bool:
    return text != "0"


def _zero_or_one(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def _fork_or_spawn(name: str, text: str) -> str | None:
    if text not in ("", "fork", "spawn"):
        raise ValueError(f"{name} must be 'fork' or 'spawn', got {text!r}")
    return text or None


def _one_of(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
    return text


def _spec_decode_attention(name: str, text: str) -> str:
    text = {"0": "varlen", "1": "decodes"}.get(text, text)  # the on/off switch it was
    return _one_of(name, text, ("auto", "multi_query", "decodes", "varlen"))


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    "TINYPAGED_KERNELS": EnvVar(
        "str", "auto",
        "who runs the ops (auto, triton or torch) when neither `kernels=` nor `--kernels` says",
        lambda name, text: text,
    ),
    "TINYPAGED_ENABLE_MULTIPROCESSING": EnvVar(
        "bool | None", None,
        "`serve` runs the engine in a process of its own (1) or in a thread (0); "
        "unset: a process on CUDA, a thread on the CPU",
        _zero_or_one,
    ),
    "TINYPAGED_WORKER_MULTIPROC_METHOD": EnvVar(
        "str | None", None,
        "how tensor-parallel workers start (fork or spawn); unset: fork until CUDA is "
        "initialized in the engine's process, then spawn",
        _fork_or_spawn,
    ),
    "TINYPAGED_API_KEY": EnvVar(
        "str | None", None,
        "the key `serve` requires of clients when `--api-key` is not given",
        lambda name, text: text or None,
    ),
    "TINYPAGED_CACHE": EnvVar(
        "Path | None", None,
        "root of the cache for the built-in model and converted .gguf files; "
        "unset: the user cache dir, e.g. ~/.cache/tinypaged",
        lambda name, text: Path(text).expanduser() if text else None,
    ),
    "TINYPAGED_GC_DEBUG": EnvVar(
        "bool", False,
        "1 logs every full garbage collection of the serving processes with its duration",
        _is_one,
    ),
    "TINYPAGED_DENSE_GEMV": EnvVar(
        "bool", True,
        "0 sends every dense decode linear to F.linear, not the Triton GEMV (for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_SPEC_DECODE_ATTENTION": EnvVar(
        "str", "auto",
        "how the attention of speculative verification graphs (k + 1 tokens a sequence) runs: "
        "multi_query (split-KV decode, a sequence's tokens in one program), decodes (one "
        "split-KV decode per token), varlen (the varlen kernel), or auto (multi_query up to 16 "
        "sequences, varlen above); 0 and 1, its earlier values, mean varlen and decodes (for A/B "
        "benchmarks)",
        _spec_decode_attention,
    ),
    "TINYPAGED_GGUF_ROWS": EnvVar(
        "bool", False,
        "1 sends GGUF decode linears of 2 to 64 rows to the tensor-core GEMV of "
        "kernels/gguf_rows.py (each weight dequantized once); 0 keeps the per-type paths of "
        "kernels/gguf.py's DECODE_PATHS (for A/B benchmarks)",
        _is_one,
    ),
    "TINYPAGED_GGUF_SUBDOT": EnvVar(
        "bool", True,
        "0 keeps kernels/gguf_rows.py for the decode linears that would take "
        "kernels/gguf_subdot.py (Q4_K at 2-16 rows: one tensor-core product per sub-block, "
        "scales applied per row) (for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_FP8_GEMV": EnvVar(
        "str", "w8a16",
        "how FP8 weights run at decode: w8a16 (x as it is, 1 row) or w8a8dot (x quantized to "
        "e4m3 in the GEMV, FP8 tensor cores, 1-16 rows)",
        lambda name, text: _one_of(name, text, ("w8a16", "w8a8dot")),
    ),
    "TINYPAGED_FP8_ROWS": EnvVar(
        "bool", True,
        "0 sends FP8 W8A8 linears of 2 to 16 rows (x quantized to e4m3 by its own kernel) to "
        "fp8_gemm's decode tiles instead of kernels/fp8_rows.py (for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_PREFILL_ATTENTION": EnvVar(
        "str", "gluon",
        "which kernel runs prefill attention on sm_90 for the shapes it covers (fp16/bf16, "
        "head_dim 128, no window or soft-cap): triton (kernels/attention_hopper.py) or gluon "
        "(kernels/attention_gluon.py, warp-specialized TMA + wgmma) (for A/B benchmarks)",
        lambda name, text: _one_of(name, text, ("triton", "gluon")),
    ),
    "TINYPAGED_MOE_ALIGN_PARALLEL": EnvVar(
        "bool", True,
        "0 sorts the fused MoE's (token, expert) pairs by expert with the one-program kernel up "
        "to 1024 pairs and torch ops above, not the two-launch kernel of kernels/moe_align.py "
        "(for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_FP8_TMA": EnvVar(
        "bool", True,
        "0 makes the FP8 kernels (kernels/fp8_rows.py, the one-row FP8 GEMV of "
        "kernels/dense_gemv.py, the FP8 GEMM of kernels/fp8.py) and the dense GEMV's 2-8-row "
        "tiles load their operands by pointer loads even where their tile tables ask for TMA "
        "(w_tma, TMA; for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_PDL": EnvVar(
        "bool", True,
        "0 stops the decode kernels (norms, GEMVs, rotary + KV store, decode attention) from "
        "chaining by programmatic dependent launch at up to 64 rows (Hopper and later; "
        "kernels/pdl.py): the A/B switch",
        _is_not_zero,
    ),
    "TINYPAGED_LORA_PDL": EnvVar(
        "bool", False,
        "1 chains the LoRA expand to its shrink by programmatic dependent launch for batches of "
        "up to 16 rows (Hopper and later; off by default: it cost offline throughput)",
        _is_one,
    ),
    "TINYPAGED_LORA_OVERLAP": EnvVar(
        "bool", True,
        "1 runs each LoRA shrink (and at decode its expand's product) on a side CUDA stream "
        "beside its layer's base matmul (both read only x); 0 runs them after, on one stream",
        _is_one,
    ),
    "TINYPAGED_LORA_SKIP_IDLE": EnvVar(
        "bool", True,
        "1 runs no LoRA kernel in a step where no sequence has an adapter (with enable_lora, "
        "CUDA graphs are captured twice: with and without LoRA); 0 runs them in every step",
        _is_not_zero,
    ),
    "TINYPAGED_GRAMMAR_THREAD": EnvVar(
        "bool", True,
        "0 runs structured output's batched grammar accepts and mask fills on the engine thread, "
        "not on a worker thread beside it (for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_GRAMMAR_PROCESS": EnvVar(
        "str", "auto",
        "where structured output's matchers live and take their tokens: auto (a process of "
        "their own when the device is a GPU, else the engine process) or 1 or 0",
        lambda name, text: _one_of(name, text, ("auto", "1", "0")),
    ),
    "TINYPAGED_SPEC_PAD_DRAFTS": EnvVar(
        "bool", True,
        "0 leaves the n-gram (and oracle) drafts as short as the proposer made them, not padded "
        "to k so that the verification replays one CUDA graph (for A/B benchmarks)",
        _is_not_zero,
    ),
    "TINYPAGED_SPEC_OVERLAP": EnvVar(
        "bool", True,
        "0 launches each speculative verification only once the tokens of the one in flight "
        "are known; by default (n-gram and the oracles, async scheduling, no pipeline stages) "
        "it is launched before, as if that one accepted every draft, and moved on the device to "
        "where it ended",
        _is_not_zero,
    ),
    "TINYPAGED_PIECEWISE_UNCHECKED": EnvVar(
        "bool", False,
        "1 captures piecewise CUDA graphs under tensor parallelism (not yet checked on GPUs)",
        _is_one,
    ),
    "TINYPAGED_TRITON_LAUNCHER": EnvVar(
        "str", "auto",
        "how Triton launches CUDA kernels: auto or python (ctypes into the CUDA driver, no C "
        "compiler needed) or native (Triton's own C launcher, built with gcc or $CC)",
        lambda name, text: _one_of(name, text, ("auto", "python", "native")),
    ),
    "TINYPAGED_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        "bool", False,
        "1 lets `serve --enable-lora` load and unload adapters over HTTP (as "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING, also read)",
        _is_one,
    ),
}


def __getattr__(name: str) -> Any:
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'tinypaged.envs' has no attribute {name!r}")
    text = os.environ.get(name)
    return var.default if text is None else var.parse(name, text)


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])
