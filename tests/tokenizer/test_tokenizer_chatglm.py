"""ChatGLM3's tokenizer without remote code, on a tiny sentencepiece model trained here.

The directory looks like a ChatGLM3 checkpoint's: tokenizer.model plus a tokenizer_config.json
that names the remote class, and a generation_config.json with the chat eos ids.
"""

import io
import json
import random

import pytest

from tinypaged.sampling.params import SamplingParams
from tinypaged.tokenizer.chatglm import SPECIAL_TOKENS, ChatGLMTokenizer
from tinypaged.tokenizer.detokenizer import IncrementalDetokenizer
from tinypaged.tokenizer.tokenizer import load_tokenizer

# The chat template ChatGLM3's tokenizer_config.json carries, as published.
CHATGLM3_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n "
    "{{ message['content'] }}{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there, what is the weather?"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow 😀?"},
]


def write_chatglm_dir(path, sp_model: bytes):
    (path / "tokenizer.model").write_bytes(sp_model)
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]},
        "tokenizer_class": "ChatGLMTokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    import sentencepiece

    words = "hello there what is the weather it sunny and tomorrow you are a helpful assistant"
    words = words.split(" ")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(300)]
    out = io.BytesIO()
    # Like ChatGLM3's model: byte fallback, no normalisation, whitespace kept as written.
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    return out.getvalue()


@pytest.fixture(scope="module")
def glm(tmp_path_factory, sp_model):
    path = write_chatglm_dir(tmp_path_factory.mktemp("chatglm"), sp_model)
    n = 320
    eos = {"eos_token_id": [2, n + 6, n + 8, n + 4], "pad_token_id": 0}  # + eop, for the test
    (path / "generation_config.json").write_text(json.dumps(eos))
    return load_tokenizer(path)


def test_loads_without_remote_code_and_numbers_the_specials(glm):
    assert isinstance(glm, ChatGLMTokenizer)
    n = glm.sp.vocab_size()
    assert [glm.special_ids[t] for t in SPECIAL_TOKENS] == list(range(n, n + 9))
    assert glm.vocab_size == n + 9
    chat_eos = {2, glm.special_ids["<|user|>"], glm.special_ids["<|observation|>"]}
    assert glm.eos_token_ids == chat_eos | {glm.special_ids["eop"]}  # generation_config's too
    assert glm.convert_ids_to_tokens([n + 1, n + 7]) == ["[gMASK]", "<|assistant|>"]
    assert set(range(n, n + 9)) <= set(glm.all_special_ids)


def test_encode_decode(glm):
    text = "hello weather 😀 你好 x\ny"
    body = glm.sp.encode(text)
    assert glm.encode(text) == [glm.special_ids["[gMASK]"], glm.special_ids["sop"], *body]
    assert glm.encode(text, add_special_tokens=False) == body
    assert glm.decode(glm.encode(text)) == text
    assert glm.decode(glm.encode(text), skip_special_tokens=False) == "[gMASK]sop" + text
    # Plain text that spells a special token stays plain text, as in the remote class.
    assert glm.special_ids["<|user|>"] not in glm.encode("<|user|>")
    # Ids beyond the vocabulary (the model pads its embedding) decode to nothing.
    assert glm.decode([*body, glm.vocab_size + 3]) == text


def test_chat_prompt_tokens_and_text(glm):
    ids = glm.apply_chat_template(MESSAGES)
    sid, sp = glm.special_ids, glm.sp
    want = [sid["[gMASK]"], sid["sop"]]
    for m in MESSAGES:
        want += [sid[f"<|{m['role']}|>"], *sp.encode("\n"), *sp.encode(m["content"])]
    assert ids == want + [sid["<|assistant|>"]]
    text = glm.render_chat(MESSAGES)
    assert text.startswith("[gMASK]sop<|system|>\n You are") and text.endswith("😀?<|assistant|>")
    assert glm.decode(ids, skip_special_tokens=False) == text
    assert glm.apply_chat_template(MESSAGES, add_generation_prompt=False) == want
    # ChatGLM3's own Jinja template renders the same text and, tokenized, the same ids.
    assert glm.render_chat(MESSAGES, chat_template=CHATGLM3_TEMPLATE) == text
    assert glm.apply_chat_template(MESSAGES, chat_template=CHATGLM3_TEMPLATE) == ids
    with pytest.raises(ValueError, match="role"):
        glm.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_tools_and_continue_final_message(glm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    # The built-in format puts the tools in the system turn (ChatGLM3's way).
    text = glm.render_chat(MESSAGES, tools=tools)
    assert '"name": "get_weather"' in text
    assert text.index("get_weather") < text.index("<|user|>")
    # A Jinja template can continue the final (assistant) message.
    partial = [*MESSAGES, {"role": "assistant", "content": "Bonjour, je"}]
    text = glm.render_chat(partial, add_generation_prompt=False,
                           chat_template=CHATGLM3_TEMPLATE, continue_final_message=True)
    assert text.endswith("Bonjour, je")
    with pytest.raises(ValueError, match="Jinja"):
        glm.render_chat(partial, add_generation_prompt=False, continue_final_message=True)


def test_streaming_a_reply(glm):
    prompt = glm.apply_chat_template(MESSAGES[:2])
    reply = "It is sunny, 😀 你好 and warm."
    out = glm.sp.encode(reply) + [glm.special_ids["<|user|>"]]
    detok = IncrementalDetokenizer(glm, prompt, SamplingParams(stop=["warm"]))
    deltas = []
    stopped_at = None
    for i, t in enumerate(out):
        if detok.update(t, skip=t in glm.eos_token_ids):
            stopped_at = i
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == "It is sunny, 😀 你好 and "
    assert detok.stop_reason == "warm" and stopped_at is not None and stopped_at < len(out) - 1


def test_missing_or_foreign_tokenizer_model(tmp_path, sp_model):
    path = write_chatglm_dir(tmp_path, sp_model)
    plain = load_tokenizer(path)  # no generation_config.json: the chat eos ids still hold
    assert plain.eos_token_ids == {
        2,
        plain.special_ids["<|user|>"],
        plain.special_ids["<|observation|>"],
    }
    (path / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match="no tokenizer.model"):
        load_tokenizer(path)
    # GLM-4's original checkpoints keep a tiktoken vocabulary in tokenizer.model.
    (path / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="not a sentencepiece model.*-hf"):
        load_tokenizer(path)
