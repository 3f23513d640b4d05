"""Tiny EAGLE-3 / EAGLE heads and GLM-4.5 MTP checkpoints in their real on-disk formats:
tinypaged/bench/tiny_heads.py (shared with the GPU check benchmarks/spec_decode_check.py)."""

from tinypaged.bench.tiny_heads import (  # noqa: F401  (the tests import them from here)
    make_bigram,
    save_eagle,
    save_eagle3,
    save_glm_mtp,
)
