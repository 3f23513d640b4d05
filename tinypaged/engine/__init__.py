"""The engine: Engine.step, LLM, AsyncLLM, the engine loop and its clients, stats."""
