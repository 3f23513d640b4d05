"""The spec-decode counters under vLLM's names (tinypaged's `tinypaged:` prefix), for the
server's /metrics and `LLM.get_metrics()`:

    tinypaged:spec_decode_num_drafts                 sequence-steps that verified >= 1 draft
    tinypaged:spec_decode_num_draft_tokens           draft tokens verified
    tinypaged:spec_decode_num_accepted_tokens        ... and accepted
    tinypaged:spec_decode_num_accepted_tokens_per_pos{position=j}   accepted at draft position j

acceptance rate = num_accepted_tokens / num_draft_tokens; mean acceptance length =
1 + num_accepted_tokens / num_drafts (tokens per verified sequence-step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFIX = "tinypaged:spec_decode_"
COUNTERS = (
    ("num_drafts", "Sequence-steps that verified at least one draft token."),
    ("num_draft_tokens", "Draft tokens verified by the target."),
    ("num_accepted_tokens", "Draft tokens accepted."),
)
PER_POS = ("num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.")


@dataclass
class Counter:  # vLLM's vllm.v1.metrics.reader.Counter
    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Vector:  # vLLM's vllm.v1.metrics.reader.Vector: one value per position
    name: str
    labels: dict[str, str]
    values: list[int]


def reader_metrics(stats: dict[str, Any] | None, labels: dict[str, str]) -> list:
    """Counter and Vector objects of the spec-decode counters (empty without speculation)."""
    if not stats:
        return []
    out: list = [Counter(PREFIX + key, dict(labels), stats[key]) for key, _ in COUNTERS]
    out.append(Vector(PREFIX + PER_POS[0], dict(labels), list(stats[PER_POS[0]])))
    return out


def log_line(stats: dict[str, Any] | None) -> str:
    """The acceptance summary the CLI logs: '' without speculation."""
    if not stats or not stats["num_drafts"]:
        return ""
    rate = stats["num_accepted_tokens"] / max(stats["num_draft_tokens"], 1)
    length = 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    per_pos = ", ".join(f"{n / stats['num_drafts']:.2f}"
                        for n in stats["num_accepted_tokens_per_pos"])
    return (f"spec decode: acceptance rate {100 * rate:.1f}%, mean acceptance length "
            f"{length:.2f}, per-position acceptance [{per_pos}], drafts {stats['num_drafts']}")
