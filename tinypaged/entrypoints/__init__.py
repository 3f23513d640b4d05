"""What users run: the CLI and the OpenAI-compatible server."""
