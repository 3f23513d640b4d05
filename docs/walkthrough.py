"""Scheduler steps on two requests that share a prompt prefix, in pure Python (no model), with
the flat batch the runner builds for each step.

    python -m docs.walkthrough

Change the numbers (block_size, the token budget, the prompts) and run it again.
"""

from tinypaged.config import EngineConfig
from tinypaged.sampling.params import SamplingParams
from tinypaged.scheduler import Scheduler, Sequence
from tinypaged.worker.input_batch import HostBlockTables, build_step

config = EngineConfig(max_model_len=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
scheduler = Scheduler(config, num_blocks=12)
tables = HostBlockTables(config.max_num_seqs, max_blocks_per_seq=8)
params = SamplingParams(max_tokens=3)
a = Sequence("a", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], params)  # a 10-token prompt
b = Sequence("b", [11, 12, 13, 14, 15, 16, 99], params)  # shares a's first 4-token block
scheduler.add(a)
for step in range(4):
    out = scheduler.schedule()
    print(f"--- step {step}")
    for it in out.scheduled:
        start = it.num_computed_tokens
        print(f"{it.seq.request_id}: positions [{start}, {start + it.num_new_tokens}) "
              f"blocks {it.seq.block_table} sample={it.sample}")
    batch = build_step(out.scheduled, config.block_size, tables)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_tables", "logits_indices"):
        print(f"  {name:16s}", getattr(batch, name).tolist())
    sampled = {it.seq.seq_id: 100 + step for it in out.scheduled if it.sample}  # "the model"
    scheduler.update(out, sampled)
    if step == 0:
        scheduler.add(b)
