"""Tokenizers (HF and ChatGLM), chat templates, the incremental detokenizer."""
