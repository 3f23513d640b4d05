"""The spec-decode counters on /metrics: vLLM's names with tinypaged's prefix, per-position
counts labelled by position, nothing without speculation."""

from prometheus_client import CollectorRegistry, generate_latest

from tinypaged.entrypoints.openai.metrics import _EngineGauges
from tinypaged.spec_decode.decoder import SpecDecodeStats


class FakeEngine:
    def __init__(self, spec):
        self.spec = spec
        self.kv_cache_info = {"block_size": 16, "num_blocks": 8}

    def get_stats(self):
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "spec_decode": self.spec}


def scrape(spec) -> str:
    registry = CollectorRegistry()
    registry.register(_EngineGauges(FakeEngine(spec), "m"))
    return generate_latest(registry).decode()


def test_spec_decode_counters_on_metrics():
    stats = SpecDecodeStats(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    text = scrape(stats.as_dict())
    assert 'tinypaged:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'tinypaged:spec_decode_num_draft_tokens_total{model_name="m"} 5.0' in text
    assert 'tinypaged:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    per_pos = "tinypaged:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="0"}} 1.0' in text
    assert f'{per_pos}{{model_name="m",position="1"}} 1.0' in text
    assert f'{per_pos}{{model_name="m",position="2"}} 0.0' in text
    assert "spec_decode" not in scrape(None)
