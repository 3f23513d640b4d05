"""Shared helpers of the server tests (no tests here): a uvicorn server in a thread, SSE and
Prometheus text parsing, FakeEngine, a test double of AsyncLLM, and ScriptedEngine, one that
answers with scripted replies (the tool-calling and translator tests: WEATHER_FUNCTION,
qwen_scripted_server)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from helpers.chat_templates import QWEN
from helpers.tokenizer import train_bpe
from tinypaged.config import EngineConfig
from tinypaged.engine.client import EngineClient
from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.outputs import CompletionOutput, RequestOutput
from tinypaged.tokenizer.tokenizer import load_tokenizer

# The tool the tool-calling tests offer, as chat's "function" object (each API wraps it its way).
WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
FAKE_KV_CACHE_INFO = {"num_blocks": 64, "block_size": 16, "num_tokens": 1024, "bytes": 0,
                      "device": "cpu", "dtype": "float32"}


@contextlib.contextmanager
def running_server(app, graceful_s: float | None = None):
    """Serve `app` on 127.0.0.1 on a free port in a background thread; yields the base URL.
    On exit the server stops like on SIGTERM, cancelling requests after `graceful_s` seconds."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=graceful_s
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(raw: str) -> list:
    """Split an SSE body into its data payloads (JSON decoded, '[DONE]' kept as a string),
    checking the framing: every event is exactly `data: ...` followed by a blank line."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (labels must match exactly)."""
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"{name} {labels} not in the metrics")


class FakeTokenizer:
    """Test double of the tokenizer: one token per character, id = code point."""

    eos_token_ids = frozenset({0})
    max_token_chars = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def render_chat(self, messages, add_generation_prompt=True, **kwargs) -> str:
        if messages[0]["role"] == "assistant":
            raise ValueError("conversation roles must start with system or user")
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


class FakeEngine(EngineClient):
    """Test double of AsyncLLM. Sample j of a request writes letters starting at
    (first prompt id + j) mod 26, one per step. Markers in the prompt: REFUSE (ValueError at
    submission), FAIL-EARLY / FAIL-LATE (RuntimeError before the first / at the third token),
    SLOW (0.5 s per step)."""

    def __init__(
        self,
        max_model_len: int = 64,
        max_num_seqs: int = 2,
        default_sampling_params: dict | None = None,
    ):
        self._config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        self._tokenizer = FakeTokenizer()
        self._defaults = default_sampling_params or {}
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.seen_params: list = []
        self.stopped = False

    tokenizer = property(lambda self: self._tokenizer)
    config = property(lambda self: self._config)
    model_name = property(lambda self: "fake-model")
    default_sampling_params = property(lambda self: self._defaults)
    is_running = property(lambda self: not self.stopped)
    kv_cache_info = property(lambda self: FAKE_KV_CACHE_INFO)

    async def shutdown(self) -> None:
        self.stopped = True

    def get_stats(self) -> dict:
        return {"num_running": len(self.live), "num_waiting": 0, "kv_cache_usage": 0.0}

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt, params, request_id):
        ids = prompt["prompt_token_ids"]
        text = self.tokenizer.decode(ids)
        if "REFUSE" in text:
            raise ValueError("the fake engine refuses this prompt")
        self.seen_params.append(params)
        self.live.add(request_id)
        samples = [CompletionOutput(j, "", []) for j in range(params.n)]
        try:
            for k in range(params.max_tokens):
                await asyncio.sleep(0.5 if "SLOW" in text else 0.001)
                if "FAIL-EARLY" in text or ("FAIL-LATE" in text and k == 2):
                    raise RuntimeError("injected engine failure")
                for c in samples:
                    if not c.finish_reason:
                        self._step(c, ord("a") + (ids[0] + c.index + k) % 26, params)
                done = all(c.finish_reason for c in samples)
                snapshot = [
                    dataclasses.replace(
                        c, token_ids=list(c.token_ids), logprobs=c.logprobs and list(c.logprobs)
                    )
                    for c in samples
                ]
                yield RequestOutput(request_id, None, ids, snapshot, finished=done)
                if done:
                    return
        finally:
            self.live.discard(request_id)

    @staticmethod
    def _step(c: CompletionOutput, token: int, params) -> None:
        c.token_ids.append(token)
        c.text += chr(token)
        if params.logprobs is not None:
            alternatives = {ord("A") + i: -2.0 - i for i in range(params.logprobs)}
            c.logprobs = (c.logprobs or []) + [{token: -0.5, **alternatives}]
        for stop in params.stop:
            if stop in c.text:
                c.text = c.text[: c.text.index(stop)]
                c.finish_reason, c.stop_reason = "stop", stop
        if not c.finish_reason and len(c.token_ids) == params.max_tokens:
            c.finish_reason = "length"


def build_tiny_model(path):
    """A tiny random llama (2 layers, hidden 64) that speaks the default model's tokenizer and
    chat template, saved as an HF directory at `path`; returns `path`."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tinypaged.models.default_model import ensure_default_model

    source = ensure_default_model()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def post(url: str, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(url + path, content=data, headers=headers, timeout=10, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    for word in words:
        assert word in err["message"], err
    return err


class ScriptedEngine(EngineClient):
    """Test double of AsyncLLM: answers each request with the next of `replies`, three
    characters per step, and keeps the prompt of every request as text in `prompts`."""

    def __init__(self, tokenizer):
        self._config = EngineConfig(max_model_len=4096, max_num_seqs=4)
        self._tokenizer = tokenizer
        self.replies: list[str] = []
        self.prompts: list[str] = []
        self.params: list = []

    tokenizer = property(lambda self: self._tokenizer)
    config = property(lambda self: self._config)
    model_name = property(lambda self: "scripted")
    default_sampling_params = property(lambda self: {})
    is_running = property(lambda self: True)
    kv_cache_info = property(lambda self: FAKE_KV_CACHE_INFO)

    async def shutdown(self) -> None:
        pass

    def get_stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}

    async def abort(self, request_id: str) -> None:
        pass

    async def generate(self, prompt, params, request_id):
        ids = prompt["prompt_token_ids"]
        self.prompts.append(self.tokenizer.decode(ids, skip_special_tokens=False))
        self.params.append(params)
        reply = self.replies.pop(0)
        for end in range(3, len(reply) + 3, 3):
            await asyncio.sleep(0)
            done = end >= len(reply)
            out = CompletionOutput(0, reply[:end], list(range(min(end, len(reply)))))
            out = dataclasses.replace(out, finish_reason="stop" if done else None)
            yield RequestOutput(request_id, None, ids, [out], finished=done)


@contextlib.contextmanager
def qwen_scripted_server(tmp_path, **app_kwargs):
    """A server on a ScriptedEngine with Qwen's chat template, hermes tool calls and the qwen3
    reasoning parser, as the translator tests (Anthropic Messages, Responses) use it; yields
    SimpleNamespace(engine, url, tok)."""
    tok = load_tokenizer(train_bpe(tmp_path, chat_template=QWEN))
    engine = ScriptedEngine(tok)
    app = build_app(engine, tool_call_parser="hermes", enable_auto_tool_choice=True,
                    reasoning_parser="qwen3", **app_kwargs)
    with running_server(app) as url:
        yield SimpleNamespace(engine=engine, url=url, tok=tok)
