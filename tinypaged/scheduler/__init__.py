"""Scheduling and KV-cache bookkeeping, in pure Python (no torch): which tokens of which
sequences run in each step, and which cache blocks hold their K/V rows."""

from tinypaged.scheduler.block_manager import BlockManager, hash_block
from tinypaged.scheduler.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from tinypaged.scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManager",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "hash_block",
]
