"""The engine: Engine.step, LLM, AsyncLLM, the one engine loop (EngineCore) that a thread or a
process runs, its clients (in-process, multiprocess), the typed messages between them, stats."""
