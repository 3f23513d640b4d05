"""Helpers the tests share: tiny models, GGUF blocks, chat templates, a running server."""
