"""OpenAI's Responses API (/v1/responses, stateless): a translator onto the chat path."""
