"""The server's LoRA adapters, as vLLM serves them (`serve --enable-lora --lora-modules ...`).

- A request's `model` field names an adapter (or the base model): the adapter's LoRARequest goes
  with every engine request of it. An unknown name is a 404 in OpenAI's error shape (check_model).
- GET /v1/models lists each adapter with `parent` = the base model's served name.
- POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
  {"lora_name"}, when runtime updates are allowed (TINYPAGED_ALLOW_RUNTIME_LORA_UPDATING=1 or
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; else 404, as in vLLM where the routes do not exist).
  An unloaded adapter leaves the engine's slots and CPU cache by their LRU.
- /metrics: `tinypaged:lora_requests_info` (vLLM's gauge: labels max_lora and
  running_lora_adapters, the adapters with requests in flight) and
  `tinypaged:lora_requests_total{lora_name}`, the requests each adapter served.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tinypaged import envs
from tinypaged.entrypoints.openai.errors import APIError, bad_request, show
from tinypaged.lora.adapter import read_config
from tinypaged.lora.request import LoRARequest

if TYPE_CHECKING:
    from tinypaged.entrypoints.openai.api_server import OpenAIServer


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules name=path ...` (vLLM's form; a JSON object {"name", "path"} also)."""
    import json

    modules = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            obj = json.loads(spec)
            name, path = obj.get("name"), obj.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        modules[name] = path
    return modules


def runtime_updates_allowed() -> bool:
    vllm = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    return vllm or envs.TINYPAGED_ALLOW_RUNTIME_LORA_UPDATING


class LoRAServing:
    """The served adapters by name, and their request counts."""

    def __init__(self, server: OpenAIServer, modules: dict[str, str]) -> None:
        self.server = server
        self.ids = itertools.count(1)
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in modules.items():
            self.add(name, path)
        self.served: Counter[str] = Counter()  # requests per adapter, ever
        server.metrics.registry.register(self)

    def add(self, name: str, path: str) -> LoRARequest:
        if name in self.server.model_names or name in self.adapters:
            raise bad_request("lora_name", f"the name {show(name)} is already served")
        try:
            read_config(Path(path))
        except ValueError as exc:
            raise bad_request("lora_path", str(exc)) from None
        self.adapters[name] = LoRARequest(name, next(self.ids), path)
        return self.adapters[name]

    def request_for(self, model: str, num_prompts: int) -> LoRARequest | None:
        """The LoRARequest of a request to `model` (None: the base model); counts it."""
        request = self.adapters.get(model)
        if request is not None:
            self.served[model] += num_prompts
        return request

    def models_data(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": self.server.created,
                 "owned_by": "tinypaged", "root": r.lora_path, "parent": self.server.model_name,
                 "max_model_len": self.server.max_model_len}
                for name, r in self.adapters.items()]

    def collect(self):
        running = sorted({gen.lora_request.lora_name for gen in self.server.active
                          if gen.lora_request is not None})
        info = GaugeMetricFamily(
            "tinypaged:lora_requests_info", "Running stats on LoRA requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(self.server.engine.config.max_loras), ",".join(running), ""],
                        time.time())
        total = CounterMetricFamily("tinypaged:lora_requests", "Requests per LoRA adapter.",
                                    labels=["lora_name"])
        for name in self.adapters:
            total.add_metric([name], self.served[name])
        return [info, total]

    async def load(self, request: Request) -> Response:
        self._check_allowed()
        body = await self.server.read_json(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        self.add(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._check_allowed()
        name = _field(await self.server.read_json(request), "lora_name")
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"the LoRA adapter {show(name)} is not loaded", param="lora_name",
                           code="model_not_found")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    def _check_allowed(self) -> None:
        if not runtime_updates_allowed():
            raise APIError(404, "runtime LoRA updates are off; start the server with "
                                "TINYPAGED_ALLOW_RUNTIME_LORA_UPDATING=1", code="not_found")


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(name, f"'{name}' must be a non-empty string")
    return value


def lora_routes(server: OpenAIServer, modules: dict[str, str]) -> list[Route]:
    """Attach the adapters to `server` (server.lora) and return the load / unload routes."""
    server.lora = lora = LoRAServing(server, modules)
    e = server.endpoint
    return [Route("/v1/load_lora_adapter", e(lora.load, auth=True), methods=["POST"]),
            Route("/v1/unload_lora_adapter", e(lora.unload, auth=True), methods=["POST"])]
