"""HF tokenizer wrapper and IncrementalDetokenizer, on a byte-level BPE trained here in ~10 ms.

The BPE learns merges from ASCII text only, so emoji and CJK characters come out as one token
per UTF-8 byte: the hard case for streaming text.
"""


import pytest
from helpers.tokenizer import CHATML, SPECIALS, train_bpe  # noqa: F401

from tinypaged.sampling.params import SamplingParams
from tinypaged.tokenizer.detokenizer import IncrementalDetokenizer, find_stop_string
from tinypaged.tokenizer.tokenizer import load_tokenizer

TEXT = "Hi there 😀! 你好, world: naïve café → 🎉🎉 done."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = train_bpe(tmp_path_factory.mktemp("bpe"), generation_eos=[0, 2])
    return load_tokenizer(path)


def test_encode_decode_and_ids(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) > len(TEXT.encode()) // 2  # multi-byte characters split into bytes
    assert tok.eos_token_ids == {0, 2}  # <|im_end|> (2) plus generation_config's list
    assert tok.vocab_size == len(tok.hf) and max(ids) < tok.vocab_size
    assert sorted(tok.all_special_ids) == [0, 1, 2]
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    with_special = [1, *tok.encode("hello", add_special_tokens=False), 2]
    assert tok.decode(with_special) == "hello"
    assert tok.decode(with_special, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_generation_config_int_eos(tmp_path):
    tok = load_tokenizer(train_bpe(tmp_path, eos="<|endoftext|>", generation_eos=2))
    assert tok.eos_token_ids == {0, 2}


def test_chat_template(tok, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
    assert tok.render_chat(messages) == want + "<|im_start|>assistant\n"
    assert tok.render_chat(messages, add_generation_prompt=False) == want
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(want + "<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens in the template are single ids
    # A template passed per call, or at load time (as a string or a file), wins.
    other = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.render_chat(messages, chat_template=other) == "[Be brief.][Hi 😀]"
    template_file = tmp_path / "t.jinja"
    template_file.write_text(other)
    path = train_bpe(tmp_path / "model")
    assert load_tokenizer(path, chat_template=str(template_file)).render_chat(messages) == (
        "[Be brief.][Hi 😀]"
    )


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(train_bpe(tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="no chat template.*chat_template="):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unloadable_directory(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call saw."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def stream(tok, prompt_ids, output_ids, params, finish=True):
    """Feed tokens one at a time; return (detokenizer, deltas streamed while running)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas = []
    for t in output_ids:
        if detok.update(t) is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    if finish:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas


def test_streaming_never_splits_a_character(tok):
    prompt = tok.encode("User says:")
    out = tok.encode(TEXT * 3)
    assert "\ufffd" in tok.decode(out[5:6]) or any("\ufffd" in tok.decode([t]) for t in out)
    counting = CountingTokenizer(tok)
    detok, deltas = stream(counting, prompt, out, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tok.decode(out) == TEXT * 3
    # Each step decodes a small window, not the whole text so far.
    assert max(counting.sizes) <= 16


def test_skip_special_tokens_in_stream(tok):
    out = tok.encode("a 😀") + [2] + tok.encode(" b<|im_start|>c", add_special_tokens=False)
    for skip in (True, False):
        detok, deltas = stream(tok, [1], out, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == detok.output_text == tok.decode(out, skip_special_tokens=skip)


def test_unfinished_character_is_flushed_at_the_end(tok):
    out = tok.encode("ok 🎉")
    out = out[: next(i for i in range(len(out)) if "\ufffd" in tok.decode(out[: i + 1])) + 1]
    detok, deltas = stream(tok, [1], out, SamplingParams(), finish=False)
    assert "".join(deltas) == "ok "  # the lone first byte of the emoji is held back
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(out)


@pytest.mark.parametrize("skip", [True, False])
def test_rust_decode_stream_streams_what_the_window_does(tok, skip):
    # A fast HF tokenizer takes tokenizers' DecodeStream; CountingTokenizer has no `.hf`, so it
    # takes the Python window: both must stream the same deltas, held characters included.
    out = tok.encode(TEXT * 2) + [2] + tok.encode(" b<|im_start|>c 🎉", add_special_tokens=False)
    out = out[:-1]  # ends inside the emoji: the final flush gives its held bytes
    prompt = tok.encode("User says:")
    fast = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
    assert fast._step is not None
    _, slow_deltas = stream(CountingTokenizer(tok), prompt, out, SamplingParams(
        skip_special_tokens=skip))
    _, fast_deltas = stream(tok, prompt, out, SamplingParams(skip_special_tokens=skip))
    assert fast_deltas == slow_deltas
    assert "".join(fast_deltas) == tok.decode(out, skip_special_tokens=skip)


def test_rust_decode_stream_survives_ids_past_the_vocabulary(tok):
    out = tok.encode("hello") + [10**6] + tok.encode(" world")
    detok, deltas = stream(tok, [1], out, SamplingParams())
    assert "".join(deltas) == detok.output_text == "hello world"


STOP_TEXT = "The answer is forty two. END of story, goodbye."


@pytest.mark.parametrize(
    ("stop", "include", "want"),
    [
        (["forty two"], False, "The answer is "),
        (["forty two"], True, "The answer is forty two"),
        (["goodbye", "END", "wer is"], False, "The ans"),  # the earliest one wins
        (["😀", "nowhere"], False, STOP_TEXT),
    ],
)
def test_stop_strings_spanning_tokens(tok, stop, include, want):
    out = tok.encode(STOP_TEXT)
    assert len(tok.encode("forty two")) > 1  # the stop string spans several tokens
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok, deltas = stream(tok, [1], out, params)
    assert detok.output_text == want
    assert "".join(deltas) == want  # streamed text never ran ahead of the final text
    hit = [s for s in stop if s in STOP_TEXT]
    assert detok.stop_reason == (min(hit, key=STOP_TEXT.index) if hit else None)


def test_streamed_prefix_is_always_final(tok):
    # While running, the last len(stop) - 1 characters stay back, so a stop string that is
    # only half generated ("E", "EN", ...) never reaches the client.
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["END of"]))
    sent, snapshots = "", []
    for t in tok.encode(STOP_TEXT):
        if detok.update(t):
            break
        sent += detok.get_next_output_text(finished=False, delta=True)
        snapshots.append(sent)
    final = sent + detok.get_next_output_text(finished=True, delta=True)
    assert final == detok.output_text == "The answer is forty two. "
    assert all(final.startswith(s) for s in snapshots)
    assert len(snapshots) > 5


def test_stop_token_text_and_min_tokens(tok):
    out = tok.encode("stop here then") + [2]
    # skip=True: the eos that ends the sequence leaves no text, unless asked to include it.
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=False))
    for t in out[:-1]:
        detok.update(t)
    detok.update(out[-1], skip=True)
    assert detok.output_text == "stop here then"
    detok = IncrementalDetokenizer(
        tok, [1], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    )
    for t in out[:-1]:
        detok.update(t)
    detok.update(out[-1], skip=True)
    assert detok.output_text == "stop here then<|im_end|>"
    # Stop strings only count once more than min_tokens tokens are out.
    n_before = len(tok.encode("stop"))
    detok, _ = stream(tok, [1], out[:-1], SamplingParams(stop=["stop", "then"], min_tokens=1))
    assert detok.stop_reason == ("stop" if n_before > 1 else "then")
    detok, _ = stream(tok, [1], out[:-1], SamplingParams(stop=["stop", "then"], min_tokens=4))
    assert detok.stop_reason == "then" and detok.output_text == "stop here "
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["here"]))
    assert all(detok.update(t, check_stop=False) is None for t in out[:-1])


def test_find_stop_string_looks_only_at_the_tail():
    assert find_stop_string("abc STOP xyz", 3, ["STOP"], False) is None  # before the new chars
    assert find_stop_string("abc STOP xyz", 7, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 1, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("xxAByy", 3, ["By", "AB"], False) == ("AB", 2)


def test_llm_loads_the_tokenizer_it_is_given(tmp_path):
    """`LLM(model, tokenizer=DIR)` reads DIR's tokenizer (it used to be ignored silently), and a
    tokenizer that is not a local path fails at once, naming it."""
    from helpers.models import save_byte_tokenizer, tiny_hf_model

    from tinypaged import LLM

    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    tiny_hf_model("llama", seed=1).save_pretrained(model_dir)  # no tokenizer files here
    save_byte_tokenizer(tok_dir)  # 256 ids, inside the tiny model's vocabulary
    llm = LLM(str(model_dir), tokenizer=str(tok_dir), num_kv_blocks=16, block_size=8,
              max_model_len=64)
    try:
        assert llm.get_tokenizer().encode(TEXT) == load_tokenizer(tok_dir).encode(TEXT)
        out = llm.generate(["Hi there"], SamplingParams(max_tokens=3, temperature=0))[0]
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    with pytest.raises(FileNotFoundError, match="not-a/local-tokenizer"):
        LLM(str(model_dir), tokenizer="not-a/local-tokenizer", num_kv_blocks=16, block_size=8,
            max_model_len=64)
