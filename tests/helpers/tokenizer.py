"""Tokenizer test helpers: a ChatML template, its special tokens and a small trained BPE."""

from __future__ import annotations

import json

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]



def train_bpe(path, eos="<|im_end|>", chat_template=CHATML, generation_eos=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words = "the quick brown fox jumps over a lazy dog and says hello to the world there"
    words = words.split(" ")
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path
