"""What the speculative-decoding tests share: a tiny Llama with the byte tokenizer."""

import pytest
from helpers.models import save_byte_tokenizer, save_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A saved tiny random Llama (fp32) with the 256-id byte tokenizer: its directory."""
    path = tmp_path_factory.mktemp("llama")
    save_tiny("llama", path)
    save_byte_tokenizer(path)
    return str(path)
