"""The OpenAI-compatible HTTP server: app, protocol, request handling, response bodies, metrics."""
