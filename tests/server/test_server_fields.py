"""Every request field does what it says or says why not (issue 32): a request's own
`chat_template` (behind --trust-request-chat-template, as vLLM) and `documents`,
`add_special_tokens` on chat, `spaces_between_special_tokens` in the detokenizer, the 400 for a
streamed chat with `prompt_logprobs`, and vLLM's warning for fields a request sends that the
server does not use (a made-up field, `length_penalty`, `vllm_xargs`)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from helpers.chat_templates import QWEN
from helpers.server import FakeEngine, ScriptedEngine, assert_error, post, running_server
from helpers.tokenizer import train_bpe

from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.sampling.params import SamplingParams
from tinypaged.tokenizer.detokenizer import IncrementalDetokenizer
from tinypaged.tokenizer.tokenizer import load_tokenizer

HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from tokenizers.processors import TemplateProcessing

    tok = load_tokenizer(train_bpe(tmp_path_factory.mktemp("qwen"), chat_template=QWEN))
    # a tokenizer that adds a bos when asked to (the default model's does not)
    bos = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    tok.hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    engine = ScriptedEngine(tok)
    with running_server(build_app(engine, trust_request_chat_template=True)) as url:
        yield engine, url


@pytest.fixture(scope="module")
def fake_engine():
    return FakeEngine(max_model_len=256)


@pytest.fixture(scope="module")
def fake(fake_engine):
    with running_server(build_app(fake_engine)) as url:
        yield url


def chat(url: str, **body):
    return post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, **body})


def test_request_chat_template_and_documents(scripted, fake):
    engine, url = scripted
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    engine.replies = ["ok"]
    docs = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    r = chat(url, chat_template=template, documents=docs)
    assert r.status_code == 200, r.text
    assert engine.prompts[-1] == "[a: first][b: second]<user>hello<assistant>"
    # without --trust-request-chat-template the request is refused, as vLLM
    assert_error(chat(fake, chat_template=template), 400, "chat_template",
                 "--trust-request-chat-template")
    assert_error(chat(fake, documents="text"), 400, "documents")


def test_add_special_tokens_on_chat(scripted):
    engine, url = scripted
    engine.replies = ["ok", "ok"]
    assert chat(url).status_code == 200
    assert engine.prompts[-1].startswith("<|im_start|>user\nhello")  # the template's own
    assert chat(url, add_special_tokens=True).status_code == 200
    assert engine.prompts[-1].startswith("<|endoftext|><|im_start|>user\nhello")


def test_streamed_chat_with_prompt_logprobs_is_a_400(fake):
    assert_error(chat(fake, stream=True, prompt_logprobs=1), 400, "prompt_logprobs",
                 "stream=True")
    assert chat(fake, stream=True, prompt_logprobs=0).status_code == 200  # as vLLM
    assert chat(fake, prompt_logprobs=1).status_code == 200


def test_unused_fields_are_logged_as_vllm_does(fake, caplog):
    with caplog.at_level(logging.WARNING):
        r = chat(fake, made_up=1, length_penalty=1.0, vllm_xargs={"k": 1})
    assert r.status_code == 200, r.text
    (line,) = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert line.startswith("The following fields were present in the request but ignored: ")
    for name in ("made_up", "length_penalty", "vllm_xargs"):
        assert name in line
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r = post(fake, "/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and not caplog.records  # a request of known fields: no word
    # fields that would change the answer are 400s, not ignored
    assert_error(chat(fake, cache_salt="s"), 400, "cache_salt", "not supported")
    assert_error(chat(fake, logits_processors=["x"]), 400, "logits_processors")


def _wordpiece():
    """A WordPiece tokenizer: its decoder puts a space before every token but '##' pieces,
    special tokens included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tinypaged.tokenizer.hf import HFTokenizer

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                 cls_token="[CLS]", pad_token="[PAD]")
    return HFTokenizer(hf, {0})


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(spaces):
    tok = _wordpiece()
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(tok, [2, 4], params)
    for token in (5, 3, 2, 3, 4):  # world [SEP] [CLS] [SEP] hello, one step each
        detok.update(token)
    text = detok.get_next_output_text(finished=True, delta=False)
    # vLLM: special tokens in a row are written bare unless spaces are asked for
    assert text == (" world [SEP] [CLS] [SEP] hello" if spaces else " world [SEP][CLS][SEP] hello")
    params = SamplingParams(spaces_between_special_tokens=spaces)  # skip_special_tokens
    skipped = IncrementalDetokenizer(tok, [2, 4], params)
    skipped.update([5, 3, 2, 4])
    assert skipped.get_next_output_text(finished=True, delta=False) == " world hello"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/responses", {"input": "SLOW"}),
])
def test_hang_up_mid_answer_aborts_within_a_step(fake_engine, fake, path, body):
    """vLLM's with_cancellation: a non-streaming request whose client hangs up while the answer
    is being generated is aborted at once (the fake engine takes 0.5 s per step)."""
    engine = fake_engine
    budget = {"max_output_tokens": 50} if path == "/v1/responses" else {"max_tokens": 50}

    async def go() -> float:
        async with httpx.AsyncClient(timeout=10) as c:
            task = asyncio.create_task(c.post(fake + path, json={**body, **budget}))
            await asyncio.sleep(0.8)  # past the first step: the answer is being generated
            assert len(engine.live) == 1
            task.cancel()
            return time.monotonic()

    before = len(engine.aborted)
    hung_up = asyncio.run(go())
    while engine.live or len(engine.aborted) == before:
        assert time.monotonic() - hung_up < 0.4, "still generating for nobody"
        time.sleep(0.01)


@pytest.mark.parametrize("side,kept", [(None, "ef"), ("left", "ef"), ("right", "ab")])
def test_truncation_side(fake, side, kept):
    body = {"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": 2,
            "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    choice = post(fake, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == [ord(ch) for ch in kept]  # the fake: id = code point
    assert_error(post(fake, "/v1/completions", {**body, "truncation_side": "middle"}), 400,
                 "truncation_side", "'left' or 'right'")
