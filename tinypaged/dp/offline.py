"""DataParallelEngine: what LLM (engine/llm.py) steps, for LLM(..., data_parallel_size=N).

It answers the part of Engine that LLM uses (tokenizer, default_sampling_params, add_request,
abort_request, has_unfinished_requests, step, shutdown) with N engine processes (launch.py)
behind the router (router.py). Each engine steps on its own; `step()` returns what arrived
since the last call, waiting for the next message when nothing has. A request an engine
refuses (bad params, a prompt too long) or the death of an engine raises from `step()`, after
the other open requests are aborted, so that LLM's call fails as a plain Engine's would.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any

from tinypaged.dp.launch import start_engines
from tinypaged.dp.router import Router
from tinypaged.engine.messages import AbortRequest, AddRequest, EngineStopped

if TYPE_CHECKING:
    from tinypaged.config import EngineConfig
    from tinypaged.outputs import RequestOutput
    from tinypaged.sampling.params import SamplingParams


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        self.clients = start_engines(config)
        ready = self.clients[0].ready
        self.config = ready.config
        self.model_name = ready.model_name
        self.default_sampling_params = ready.default_sampling_params
        self.router = Router(len(self.clients), self.config.block_size,
                             config.data_parallel_routing)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (engine, message)
        self._owner: dict[str, int] = {}  # request id -> engine, while unfinished
        self._prompts: dict[str, tuple] = {}  # the prompt, from a request's first output
        self._stopped = False
        for i, client in enumerate(self.clients):
            client.start(lambda message, i=i: self._inbox.put((i, message)))

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        i = self.router.choose(prompt)
        self._owner[request_id] = i
        self.clients[i].send(AddRequest(request_id, prompt, params))

    def abort_request(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        self._prompts.pop(request_id, None)
        if i is not None:
            self.router.finished(i)
            self.clients[i].send(AbortRequest(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """The outputs that arrived since the last call (only the finished ones when
        `finished_only`); waits for one message when none is there."""
        got = [self._inbox.get()]
        while True:
            try:
                got.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        outputs: list[RequestOutput] = []
        for i, message in got:
            if isinstance(message, EngineStopped):
                if not self.router.alive[i]:
                    continue
                self.router.mark_dead(i)
                if not self._stopped:
                    self._fail(RuntimeError(f"data-parallel engine {i} stopped: "
                                            f"{message.error or 'shut down'}"))
                continue
            for request_id, error in message.errors:
                if request_id in self._owner:
                    self._fail(error)
            for out in message.outputs:
                outputs += self._take(out)
        return [o for o in outputs if o.finished] if finished_only else outputs

    def _take(self, out: RequestOutput) -> list[RequestOutput]:
        if out.request_id not in self._owner:
            return []  # aborted since
        if out.prompt_token_ids is None:
            out.prompt, out.prompt_token_ids = self._prompts[out.request_id]
        else:
            self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
        if out.finished:
            self.router.finished(self._owner.pop(out.request_id))
            self._prompts.pop(out.request_id, None)
        return [out]

    def _fail(self, error: BaseException) -> None:
        for request_id in list(self._owner):
            self.abort_request(request_id)
        raise error

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for client in self.clients:
            client.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001, S110 - interpreter teardown
            pass
