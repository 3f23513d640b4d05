"""Pooling models against transformers, on tiny random Qwen3 / Qwen2 checkpoints:
sentence-transformers embedding checkpoints (last-token and mean pooling, written here), a
Qwen3-Reranker-style yes/no scorer and a *ForSequenceClassification head.

Each reference is computed in transformers in float32: the embedding is the pooled
last_hidden_state (normalized when the checkpoint has a Normalize module); the rerank score is
sigmoid(logit("yes") - logit("no")) of the last position; the classifier applies score.weight
to the last position."""

from __future__ import annotations

import pytest
import torch
from helpers.models import save_byte_tokenizer, single_thread, tiny_hf_model  # noqa: F401
from helpers.pooling import reference_embedding, write_embedding_checkpoint

from tinypaged import LLM, PoolingParams
from tinypaged.pooling.prompts import qwen3_rerank_text

ENGINE = {"max_model_len": 128, "num_kv_blocks": 64, "dtype": "float32",
          "max_num_batched_tokens": 40}  # small: the longer prompts prefill in chunks
PROMPTS = ["hello pooling world", "a", "the quick brown fox jumps over the lazy dog again!",
           "paged attention"]


@pytest.mark.parametrize(("kind", "mode", "normalize", "async_scheduling"),
                         [("qwen3", "last", True, False), ("qwen2", "mean", False, True)])
def test_embeddings_match_transformers(tmp_path, kind, mode, normalize, async_scheduling):
    # Async scheduling (the CUDA default) launches step N+1 before processing step N: the
    # chunked mean-pooled prompts then accumulate across steps that overlap.
    ref_model = write_embedding_checkpoint(tmp_path, kind, mode, normalize)
    llm = LLM(str(tmp_path), **ENGINE, async_scheduling=async_scheduling)
    assert llm.engine.config.runner == "pooling"  # found in modules.json
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        ref = reference_embedding(ref_model, ids, mode, normalize)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 1 - 1e-5
        if not normalize:  # the raw pooled hidden state, not only its direction
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # Matryoshka: the first `dimensions` entries, then normalized (normalize=True asked here).
    cut = llm.embed(PROMPTS[0], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    ref = reference_embedding(ref_model, llm.tokenizer.encode(PROMPTS[0]), mode, False)[:16]
    got = torch.tensor(cut[0].outputs.embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(ref, dim=-1), atol=1e-5,
                               rtol=1e-4)
    # score on an embedding model: cosine similarity of the two embeddings
    scores = llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False)
    embs = [reference_embedding(ref_model, llm.tokenizer.encode(p), mode, True)
            for p in PROMPTS[:3]]
    for s, e in zip(scores, embs[1:]):
        assert abs(s.outputs.score - float(embs[0] @ e)) < 1e-4
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="dimensions must be <="):
        llm.embed("hi", PoolingParams(dimensions=10_000), use_tqdm=False)


def save_yes_no_tokenizer(path) -> None:
    """Bytes plus three merges, so that "yes" and "no" are single tokens (256 ye, 257 yes,
    258 no), as they are in Qwen's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"ye": 256, "yes": 257, "no": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("y", "e"), ("ye", "s"), ("n", "o")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


def test_qwen3_reranker_scores_are_the_yes_no_formula(tmp_path):
    path = tmp_path / "Tiny-Qwen3-Reranker"  # a Qwen3 checkpoint named *Reranker*
    path.mkdir()
    hf = tiny_hf_model("qwen3", seed=7, vocab_size=260, max_position_embeddings=512)
    hf.save_pretrained(path)
    save_yes_no_tokenizer(path)
    llm = LLM(str(path), **{**ENGINE, "max_model_len": 512, "max_num_batched_tokens": 1024})
    assert llm.engine.config.pooler_config["yes_no_token_ids"] == [258, 257]  # no, yes
    docs = ["paris is the capital", "bananas are yellow", "no"]
    outs = llm.score("capital of france?", docs, use_tqdm=False)
    for doc, out in zip(docs, outs):
        ids = llm.tokenizer.encode(qwen3_rerank_text("capital of france?", doc),
                                   add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref = torch.sigmoid(logits[257] - logits[258])
        assert abs(out.outputs.score - float(ref)) < 1e-5


def test_sequence_classification_head(tmp_path):
    import transformers

    config = tiny_hf_model("qwen2", seed=1).config
    config.num_labels, config.pad_token_id = 3, 0
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    hf = transformers.Qwen2ForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.engine.config.pooler_config["labels"] == ["LABEL_0", "LABEL_1", "LABEL_2"]
    outs = llm.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="not embeddings"):
        llm.embed("hi", use_tqdm=False)


def test_detection_reads_the_checkpoint(tmp_path):
    """Which runner and pooler each kind of checkpoint gets (no model is built)."""
    from types import SimpleNamespace

    from tinypaged.pooling.config import detect_pooler

    causal = SimpleNamespace(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    assert detect_pooler(tmp_path, causal, "auto", tmp_path) is None  # plain: generative
    assert detect_pooler(tmp_path, causal, "pooling", tmp_path)["pooling_type"] == "LAST"
    chatglm = SimpleNamespace(architectures=["ChatGLMModel"], model_type="chatglm")
    assert detect_pooler(tmp_path, chatglm, "auto", tmp_path) is None
    bare = SimpleNamespace(architectures=["Qwen2Model"], model_type="qwen2")
    assert detect_pooler(tmp_path, bare, "auto", tmp_path)["task"] == "embed"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    pooler = detect_pooler(tmp_path, causal, "auto", tmp_path)
    assert (pooler["pooling_type"], pooler["normalize"]) == ("CLS", False)
    (tmp_path / "modules.json").write_text(
        '[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},'
        ' {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]')
    with pytest.raises(ValueError, match="'Dense' module"):
        detect_pooler(tmp_path, causal, "auto", tmp_path)
