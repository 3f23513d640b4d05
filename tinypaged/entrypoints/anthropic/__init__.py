"""Anthropic's Messages API (/v1/messages): a translator onto the OpenAI server's chat path."""
