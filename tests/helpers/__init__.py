"""Helpers the tests share: tiny models, paged attention batches, GGUF blocks, chat templates, a
running server."""
