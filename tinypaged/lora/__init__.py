"""Multi-LoRA serving: PEFT adapters (adapter.py), their GPU slots and CPU cache with LRU
eviction (slots.py), the per-layer stacked weights and the per-token slot index the linear layers
read (layers.py), and vLLM's LoRARequest (request.py)."""
