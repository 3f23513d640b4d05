"""The OpenAI server as a Ray Serve application: engine replicas across nodes behind one ingress.

    from ray import serve
    from tinypaged.entrypoints.ray_serve import build_app
    serve.run(build_app("Qwen/Qwen3-0.6B", num_replicas=2), route_prefix="/")
    # or: tinypaged serve Qwen/Qwen3-0.6B --ray --num-replicas 2

Two deployments (`pip install 'tinypaged[ray]'`):

    HTTP --> OpenAIIngress (Serve's proxy; routes)      EngineReplica x N (any node)
             the OpenAI routes of api_server.py over    AsyncLLM: one engine each (its own
             ServeEngineClient: each request is one     TP / PP inside, if asked)
             streaming call generate(prompt, ...) ----> yields RequestOutputs
             through a handle whose router is
             PrefixAffinityRouter (router.py)

The ingress tokenizes, templates and validates as `tinypaged serve` does, then the router picks
the replica most likely to hold the prompt's prefix in its cache (else the least loaded).
`num_replicas` is fixed, or `autoscaling_config` (Serve's) scales the replicas on their queue
length: `target_ongoing_requests` requests waiting or running per replica (AUTOSCALING below).

Failures. A replica whose engine stopped fails Serve's health check and is replaced. A replica
that dies (killed, node lost) ends the streams it was serving with an error (the client gets a
5xx, or an error event in a stream), never a hang; requests not yet started on it are routed
to the others. Serve retries nothing that already reached a replica.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from tinypaged.config import EngineConfig
from tinypaged.dp.client import merged_stats
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.engine.client import EngineClient
from tinypaged.entrypoints.openai.api_server import build_app as build_openai_app
from tinypaged.outputs import RequestOutput
from tinypaged.sampling.params import SamplingParams
from tinypaged.worker.ray_executor import import_ray

# Serve's autoscaling on queue length: replicas between min and max, aiming at this many
# requests (waiting or running) on each; Serve's own defaults for the rest.
AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}


class EngineReplica:
    """One engine (AsyncLLM, its loop in a thread of the replica) per Serve replica."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from ray import serve

        self.engine = AsyncLLM(**engine_kwargs)
        self.replica = serve.get_replica_context().replica_id.unique_id

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"config": e.config, "model_name": e.model_name, "kv_cache_info": e.kv_cache_info,
                "default_sampling_params": e.default_sampling_params, "replica": self.replica}

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[tuple[RequestOutput, dict | None]]:
        """The request's outputs; the last one comes with this replica's engine stats."""
        async for out in self.engine.generate(prompt, params, request_id):
            yield out, ({"replica": self.replica, **self.engine.get_stats()}
                        if out.finished else None)

    def check_health(self) -> None:  # Serve replaces a replica whose engine stopped
        if not self.engine.is_running:
            raise RuntimeError("the engine of this replica has stopped")


class ServeEngineClient(EngineClient):
    """The EngineClient of api_server.py over the replicas' handle (one call per request)."""

    def __init__(self, handle, info: dict[str, Any], tokenizer) -> None:
        self.handle = handle.options(stream=True)
        self.info, self._tokenizer = info, tokenizer
        self._open: dict[str, Any] = {}  # request id -> its call, while in flight
        self._stats: dict[str, dict] = {}  # replica -> its engine stats at its last answer

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.info["config"]

    @property
    def model_name(self) -> str:
        return self.info["model_name"]

    @property
    def default_sampling_params(self) -> dict:
        return self.info["default_sampling_params"]

    @property
    def kv_cache_info(self) -> dict:
        return self.info["kv_cache_info"]

    @property
    def is_running(self) -> bool:  # Serve replaces replicas; the ingress serves meanwhile
        return True

    def get_stats(self) -> dict:
        """The engine stats of every replica as of its last answer, summed."""
        return merged_stats(list(self._stats.values()))

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        import ray

        if request_id in self._open:
            raise ValueError(f"request_id {request_id!r} is already in use")
        call = self.handle.generate.remote(prompt, params, request_id)
        self._open[request_id] = call
        finished = False
        try:
            async for out, stats in call:
                if stats is not None:
                    self._stats[stats.pop("replica")] = stats
                finished = out.finished
                yield out
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise RuntimeError(f"the engine replica serving request {request_id} stopped: "
                               f"{type(exc).__name__}") from exc
        finally:
            self._open.pop(request_id, None)
            if not finished:  # closed early (a disconnect, an abort): the replica drops it
                call.cancel()

    async def abort(self, request_id: str) -> None:
        call = self._open.get(request_id)
        if call is not None:
            call.cancel()

    async def shutdown(self) -> None:  # the replicas belong to Serve
        self._open.clear()


class OpenAIIngress:
    """The OpenAI routes (api_server.build_app) over the engine replicas."""

    async def __init__(self, engines, server_kwargs: dict[str, Any]) -> None:
        from tinypaged.models.loader import resolve_model
        from tinypaged.tokenizer.tokenizer import load_tokenizer, tokenizer_path

        info = await engines.info.remote()
        config: EngineConfig = info["config"]
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            tokenizer_path(config.tokenizer, resolve_model(config.model)),
            chat_template=config.chat_template)
        self.engine = ServeEngineClient(engines, info, tokenizer)
        self.server_kwargs = server_kwargs

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.engine, **self.server_kwargs)


def _gpus_per_replica(config: EngineConfig) -> int:
    """tp * pp GPUs for an engine on CUDA (config.device, else: this machine has GPUs)."""
    import torch

    device = config.device or ("cuda" if torch.cuda.device_count() > 0 else "cpu")
    cuda = device.startswith("cuda")
    return config.tensor_parallel_size * config.pipeline_parallel_size if cuda else 0


def _runtime_env() -> dict:
    """This checkout on every replica's path (as ray_executor.py does for its actors)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def build_app(model: str | None = None, *, num_replicas: int | None = None,
              autoscaling_config: dict | None = None, replica_resources: dict | None = None,
              max_ongoing_requests: int | None = None, served_model_name=None,
              api_key: str | None = None, max_queue: int | None = None,
              server_options: dict | None = None, **engine_kwargs: Any):
    """The Serve application: `serve.run(build_app(...), route_prefix="/")`.

    model, engine_kwargs: as LLM / AsyncLLM (each replica builds one engine from them).
    num_replicas: a fixed count; else autoscaling_config (default AUTOSCALING) scales the
    replicas on their queue length. replica_resources: Ray resources of each replica (default
    1 CPU, and tensor_parallel_size * pipeline_parallel_size GPUs when the engine runs on CUDA).
    max_ongoing_requests: per replica (default max_num_seqs).
    served_model_name, api_key, max_queue, server_options: as api_server.build_app."""
    import_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    config = EngineConfig.from_kwargs(model=model, **engine_kwargs)  # bad values fail here
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    scaling = ({"num_replicas": num_replicas} if num_replicas is not None else
               {"autoscaling_config": autoscaling_config or AUTOSCALING})
    router = RequestRouterConfig(
        request_router_class="tinypaged.entrypoints.ray_serve.router.PrefixAffinityRouter",
        request_router_kwargs={"block_size": config.block_size})
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(
        **scaling,
        max_ongoing_requests=max_ongoing_requests or config.max_num_seqs,
        ray_actor_options={"num_cpus": 1, "num_gpus": _gpus_per_replica(config),
                           **(replica_resources or {}), "runtime_env": _runtime_env()},
        request_router_config=router,
        health_check_period_s=5,
    ).bind({"model": model, **engine_kwargs})
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress").options(
        ray_actor_options={"num_cpus": 0, "runtime_env": _runtime_env()},
        max_ongoing_requests=1 << 16)
    server_kwargs = {"served_model_name": served_model_name, "api_key": api_key,
                     "max_queue": max_queue, **(server_options or {})}
    return ingress.bind(engines, server_kwargs)


def run(app, host: str = "127.0.0.1", port: int = 8000) -> None:
    """`tinypaged serve --ray`: run `app` on the Ray cluster ($RAY_ADDRESS, else a local one)
    until Ctrl-C, then delete it."""
    import time

    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="tinypaged", route_prefix="/")
    print(f"serving the OpenAI API on Ray Serve at http://{host}:{port}/v1 (Ctrl-C to stop)",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete("tinypaged")
        serve.shutdown()
