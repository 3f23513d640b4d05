"""Fixtures of the structured-output tests: a tiny Llama with SmolLM2's 49,152-token vocabulary
(the grammars need a real tokenizer), one model folder and one engine per test module."""

import pytest
from helpers.structured import save_tiny_with_smollm2_vocab

from tinypaged import LLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_smol_vocab")
    save_tiny_with_smollm2_vocab(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=64, block_size=8)
