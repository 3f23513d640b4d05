"""The `tinypaged` command (also `python -m tinypaged`).

    tinypaged serve [MODEL] [--port 8000 ...]     OpenAI-compatible server (flags as `vllm serve`)
    tinypaged generate [MODEL] "prompt" [--chat]  print one completion
    tinypaged chat [MODEL]                        interactive chat, streaming tokens
    tinypaged download                            fetch the built-in default model, print its path
    tinypaged bench ... / tinypaged quantize ...  see `tinypaged bench --help` / `quantize --help`

MODEL (a HF directory, hub id or .gguf file) defaults to the built-in SmolLM2-135M-Instruct.
A user mistake (a bad flag, a model that cannot be loaded) ends with one `tinypaged: error:` line
and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from tinypaged import envs
from tinypaged.bench.model_shapes import SHAPES
from tinypaged.config import CUDAGRAPH_MODES
from tinypaged.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS
from tinypaged.quantization.registry import QUANTIZATION_FORMATS

logger = logging.getLogger("tinypaged")

# In-flight requests get this long to finish after Ctrl-C / SIGTERM; then they end with a 503.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


class UserError(Exception):
    """A mistake the user can fix: reported as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's knobs, named as in `vllm serve` (defaults: EngineConfig's)."""
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="this engine's share of the GPU's memory, weights and KV cache included")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV-cache size")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--cudagraph-mode", default="FULL_AND_PIECEWISE", choices=list(CUDAGRAPH_MODES),
        help="FULL_AND_PIECEWISE (default): steps with prompt tokens replay graphs of the pieces "
             "between attentions too; FULL_DECODE_ONLY: only pure-decode steps use graphs "
             "(vLLM: --compilation-config '{\"cudagraph_mode\": ...}')")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the GPU runs this one (default: on CUDA)")
    p.add_argument("--speculative-config", type=_json_dict, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (docs/speculative.md)')
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): an e4m3 KV cache holding "
                        "twice the tokens (per-tensor scale 1.0)")
    p.add_argument(
        "--quantization", default=None, choices=list(QUANTIZATION_FORMATS),
        help="the checkpoint's format (default: read from it): " + "; ".join(
            f"{name} = {fmt.description}" for name, fmt in QUANTIZATION_FORMATS.items()),
    )
    p.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"],
        help="dummy = random weights in the model's shape, its real tokenizer (benchmarks: no "
        "weights to download)",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="the model's layers cut into this many stages (x tp ranks each)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling = embeddings / scores (default: read from the checkpoint)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="all tensor-parallel all-reduces through NCCL")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine processes behind one router, each on its GPUs or sharing them")
    p.add_argument("--data-parallel-routing", default="cache_aware",
                   choices=["cache_aware", "least_loaded", "round_robin"])
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="tensor-parallel ranks as processes (mp, default) or Ray actors (ray: "
                   "one node or several; pip install 'tinypaged[ray]')")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template")
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: the model's generation_config.json (auto), none (vllm), or DIR's",
    )
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch's CPU threads (default: $OMP_NUM_THREADS, else the usable cores "
                   "minus one)")
    p.add_argument(
        "--kernels", default=envs.TINYPAGED_KERNELS,
        choices=["auto", "triton", "torch"],
        help="who runs the ops: auto = Triton on CUDA, torch references on the CPU; triton = "
        "Triton everywhere (the Triton interpreter on the CPU: slow, shows kernel edits); "
        "torch = the references (default: $TINYPAGED_KERNELS or auto)",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (lora/)")
    p.add_argument("--max-loras", type=int, default=1, help="LoRA adapters per batch (GPU slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank (<= 256)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="LoRA adapters kept on CPU")


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible text")


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _json_list(text: str) -> list[str]:
    """A flag value like vLLM's --allowed-origins: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'want a JSON list of strings like ["*"], got {text!r}')
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tinypaged", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("model", nargs="?", default=None, help="default: built-in SmolLM2")
    serve.add_argument(
        "--model-shape", default=None, choices=sorted(SHAPES),
        help="serve a named shape instead of MODEL: random weights (--load-format dummy) and a "
        "made-up one-word-per-id tokenizer of its vocabulary (see bench/model_shapes.py)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (with --enable-lora)")
    serve.add_argument("--api-key", default=None, help="also read from $TINYPAGED_API_KEY")
    serve.add_argument(
        "--max-queue",
        type=int,
        default=None,
        metavar="N",
        help="requests allowed to wait beyond --max-num-seqs before 503",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto")',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format (hermes: Qwen/Hermes, llama3_json, glm45/glm47)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> into reasoning_content",
    )
    for what in ("origins", "methods", "headers"):
        serve.add_argument(
            f"--allowed-{what}",
            type=_json_list,
            default=["*"],
            metavar="JSON",
            help=f'CORS: allowed {what} as a JSON list (default ["*"])',
        )
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies")
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens from the prefix cache",
    )
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob tokens as 'token_id:<id>' for every request (vLLM's flag)",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests pass their own 'chat_template' (vLLM: refused by default)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, how long requests in flight may still run before they are "
        "ended with an error",
    )
    serve.add_argument("--seed", type=int, default=0, help="engine seed")
    serve.add_argument("--ray", action="store_true", help="serve replicas of the engine on Ray "
                       "Serve ($RAY_ADDRESS or a local cluster; entrypoints/ray_serve)")
    serve.add_argument("--num-replicas", type=int, default=None, metavar="N",
                       help="with --ray: N replicas (default: autoscaling on queue length)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    _engine_flags(serve)

    gen = sub.add_parser("generate", help="print the completion of one prompt")
    gen.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_flags(gen, max_tokens=64)
    _engine_flags(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("model", nargs="?", default=None)
    chat.add_argument("--system", default=None, help="a system message")
    _sampling_flags(chat, max_tokens=512)
    _engine_flags(chat)

    sub.add_parser("download", help="fetch the built-in default model and print its path")
    for name in ("bench", "quantize"):  # parsed by their own modules
        sub.add_parser(name, help=f"see 'tinypaged {name} --help'", add_help=False)
    return parser


def _engine_kwargs(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    chat_template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise UserError(f"--chat-template {args.chat_template}: no such file")
        chat_template = path.read_text()
    return {
        "model": model,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_kv_blocks": args.num_kv_blocks,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "cudagraph_mode": args.cudagraph_mode,
        "async_scheduling": args.async_scheduling,
        "speculative_config": args.speculative_config,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "disable_custom_all_reduce": args.disable_custom_all_reduce,
        "data_parallel_size": args.data_parallel_size,
        "data_parallel_routing": args.data_parallel_routing,
        "distributed_executor_backend": args.distributed_executor_backend,
        "chat_template": chat_template,
        "generation_config": args.generation_config,
        "kernels": args.kernels,
        "load_format": args.load_format,
        "runner": args.runner,
        "cpu_threads": args.cpu_threads,
        **({"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "max_cpu_loras": args.max_cpu_loras} if args.enable_lora else {}),
    }


def _load(cls, kwargs: dict[str, Any]):
    """Build an LLM / AsyncLLM; any failure to load becomes one UserError line."""
    model = kwargs.get("model")
    if kwargs.get("load_format") == "dummy" and (model is None or model.lower().endswith(".gguf")):
        raise UserError(
            f"--load-format dummy needs a Hugging Face model folder or hub id (config.json and "
            f"tokenizer files), got {model or 'the built-in GGUF default model'}; pass one, or "
            f"--model-shape NAME (serve)"
        )
    try:
        return cls(**kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        logger.debug("engine start failed", exc_info=True)
        what = kwargs.get("model") or "the default model"
        raise UserError(f"cannot load {what}: {type(exc).__name__}: {exc}") from None


def _sampling(args: argparse.Namespace):
    from tinypaged.sampling.params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


# ---------------------------------------------------------------------------------- commands


def _lora_modules(args: argparse.Namespace) -> dict[str, str]:
    from tinypaged.entrypoints.openai.lora_routes import parse_lora_modules

    if args.lora_modules and not args.enable_lora:
        raise UserError("--lora-modules needs --enable-lora")
    try:
        return parse_lora_modules(args.lora_modules or [])
    except ValueError as exc:
        raise UserError(str(exc)) from None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tinypaged.engine.async_llm import AsyncLLM
    from tinypaged.engine.core import use_engine_process
    from tinypaged.entrypoints.openai.api_server import GracefulServer, build_app
    from tinypaged.gc_freeze import freeze_gc_heap

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.max_queue is not None and args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    api_key = args.api_key or envs.TINYPAGED_API_KEY
    model, served_model_name = args.model, args.served_model_name
    if args.model_shape is not None:
        if model is not None:
            raise UserError(f"give MODEL ({model}) or --model-shape, not both")
        from tinypaged.bench.model_shapes import shape_dir

        model = str(shape_dir(args.model_shape, args.quantization, tokenizer=True))
        args.load_format = "dummy"
        served_model_name = served_model_name or [args.model_shape]
    if args.ray:  # replicas on Ray Serve, the server's options as here
        from tinypaged.entrypoints.ray_serve import app as ray_serve

        options = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser",
                   "enable_prompt_tokens_details", "trust_request_chat_template",
                   "return_tokens_as_token_ids")
        kwargs = {**_engine_kwargs(args, model), "seed": args.seed, "api_key": api_key,
                  "num_replicas": args.num_replicas, "served_model_name": served_model_name,
                  "max_queue": args.max_queue,
                  "server_options": {k: getattr(args, k) for k in options}}
        ray_serve.run(_load(ray_serve.build_app, kwargs), args.host, args.port)
        return 0
    try:  # the engine loop in a process of its own on CUDA (engine/core.py), as vLLM
        multiprocess_mode = use_engine_process(args.device)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.data_parallel_size > 1:  # N engine processes behind a router (dp/)
        from tinypaged.dp.client import DPAsyncLLM as AsyncLLM  # noqa: N814
    engine = _load(AsyncLLM, {**_engine_kwargs(args, model), "seed": args.seed,
                              "multiprocess_mode": multiprocess_mode})
    app = build_app(
        engine,
        served_model_name,
        api_key,
        args.max_queue,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        trust_request_chat_template=args.trust_request_chat_template,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        **({"lora_modules": _lora_modules(args)} if args.enable_lora or args.lora_modules
           else {}),
        cors={
            "allow_origins": args.allowed_origins,
            "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers,
            "allow_credentials": args.allow_credentials,
        },
    )
    server = app.state.server
    kv = engine.kv_cache_info
    logger.info("model: %s (served as %s)", engine.model_name, ", ".join(server.model_names))
    logger.info(
        "device: %s, dtype: %s, max_model_len: %d", kv["device"], kv["dtype"], server.max_model_len
    )
    logger.info(  # once: the engine's own line is at debug level (its process may log nowhere)
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB",
        kv["num_blocks"], kv["block_size"], kv["num_tokens"], kv["bytes"] / 2**30,
    )
    if api_key:
        logger.info("API key required (Authorization: Bearer ...)")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    userver = GracefulServer(config, server, args.shutdown_timeout)
    freeze_gc_heap()  # this process lives as long as the server (gc_freeze.py)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("serving the OpenAI API at http://%s:%d/v1 (Ctrl-C to stop)", shown, args.port)
    # uvicorn handles SIGINT / SIGTERM itself (GracefulServer: stop admitting, let requests
    # finish up to --shutdown-timeout, end the rest with an error), then re-raises the signal
    # to the handler it found installed. Installing a no-op one lets us shut the engine down
    # and exit 0 afterwards.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        userver.run()
    finally:
        asyncio.run(engine.shutdown())
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("server stopped")
    return 0 if userver.started else 1



def generate(args: argparse.Namespace) -> int:
    from tinypaged.engine.llm import LLM

    if len(args.args) > 2:
        raise UserError(
            f"expected [MODEL] PROMPT, got {len(args.args)} arguments; quote the prompt"
        )
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    params = _sampling(args)
    llm = _load(LLM, _engine_kwargs(args, model))
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    from tinypaged.spec_decode.metrics import log_line

    if line := log_line(llm.engine.get_stats().get("spec_decode")):
        print(f"tinypaged: {line}", file=sys.stderr)
    return 0


def chat(args: argparse.Namespace) -> int:
    from tinypaged.engine.async_llm import AsyncLLM

    if args.data_parallel_size > 1:
        from tinypaged.dp.client import DPAsyncLLM as AsyncLLM  # noqa: N814
    params = _sampling(args)
    engine = _load(AsyncLLM, _engine_kwargs(args, args.model))
    print(f"chatting with {engine.model_name}; /exit or Ctrl-D to quit", file=sys.stderr)
    try:
        asyncio.run(_chat_loop(engine, params, args.system))
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        asyncio.run(engine.shutdown())
    return 0


async def _chat_loop(engine, params, system: str | None) -> None:
    history = [{"role": "system", "content": system}] if system else []
    loop = asyncio.get_running_loop()
    turn = 0
    while True:
        try:
            line = await loop.run_in_executor(None, input, "> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        shown = ""
        turn += 1
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"chat-{turn}"):
            text = out.outputs[0].text
            print(text[len(shown) :], end="", flush=True)
            shown = text
        print()
        history.append({"role": "assistant", "content": shown})


def download(args: argparse.Namespace) -> int:
    from tinypaged.models.default_model import ensure_default_model

    try:
        path = ensure_default_model()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - pip, network, disk: all reported as one line
        raise UserError(f"cannot fetch the default model: {type(exc).__name__}: {exc}") from None
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("bench", "quantize"):  # their own parsers take the rest
        import importlib

        module = {"bench": "tinypaged.bench.offline", "quantize": "tinypaged.quantization.quantize"}
        result = importlib.import_module(module[argv[0]]).main(argv[1:])
        return result if isinstance(result, int) else 0
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "warning").upper()  # serve: info by default
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    command = {"serve": serve, "generate": generate, "chat": chat, "download": download}
    try:
        return command[args.command](args)
    except UserError as exc:
        print(f"tinypaged: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
