"""The draft-model proposer (vLLM's "draft_model": `{"model": PATH, "num_speculative_tokens":
k}`): a smaller model with the target's tokenizer proposes k tokens by greedy decoding, on its
own paged KV cache, k forward passes per target step. Under tensor parallelism the draft is not
sharded: rank 0 alone builds and runs it, whole, on its own device (distributed.local()), and
the workers never see it.

Each proposing sequence has a draft twin (a `Sequence` of this proposer's own, with its own
blocks from its own BlockManager). At each step the twin takes the target's tokens; its cache is
valid up to the longest common prefix of its old tokens (the target's plus last step's drafts)
and the new ones, so the rejected drafts are rolled back and the accepted ones are already
computed. Then k steps: the first computes what is missing (the whole prompt the first time,
then the bonus token and the last draft) and every step adds the argmax as the next draft.

Greedy drafts are a point mass q = onehot(x), so the rejection sampler's rule keeps the target's
distribution for sampled requests as well (rejection_sampler.py). A twin is freed once its
sequence finishes (an aborted one's at the next step); when the draft cache is full a sequence
proposes nothing that step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.scheduler.block_manager import BlockManager
from tinypaged.spec_decode.grammar import DraftGrammar
from tinypaged.spec_decode.proposers import Proposer


class DraftModelProposer(Proposer):
    def __init__(self, model: str, engine: Any) -> None:
        from tinypaged.worker.executor import UniprocExecutor

        target = engine.config
        if target.pipeline_parallel_size != 1:
            raise ValueError(
                "speculative_config: a draft model runs on the last pipeline stage's rank 0; "
                "pipeline_parallel_size > 1 cannot be combined with it in tinypaged yet"
            )
        config = EngineConfig(
            model=model, dtype=target.dtype, device=str(engine.device),
            block_size=target.block_size, max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.max_num_batched_tokens,
            max_model_len=target.max_model_len, enable_prefix_caching=False,
            num_kv_blocks=engine.runner.kv_cache_info.num_blocks,
            # CUDA graphs as the target's: drafting steps 2..k are one-token decodes (the full
            # graphs), the first has the bonus token and the last draft (piecewise graphs);
            # eager, a small draft's step is its host's launches, many times its GPU time
            enforce_eager=target.enforce_eager, cudagraph_mode=target.cudagraph_mode,
            async_scheduling=False, skip_tokenizer_init=True, seed=target.seed,
            load_format=target.load_format, kernels=target.kernels,
        )
        with distributed.local():  # under tensor parallelism: whole, on rank 0's device
            self.executor = UniprocExecutor(config, engine.device)
            self.runner = self.executor.init_runner()
        self.vocab_size = engine.vocab_size
        draft_vocab = getattr(self.executor.model, "vocab_size", None)
        if draft_vocab is not None and draft_vocab < self.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({draft_vocab}) is smaller "
                f"than the target's ({self.vocab_size}); it must share the target's tokenizer"
            )
        self.blocks = BlockManager(self.runner.kv_cache_info.num_blocks, target.block_size, False)
        # seq_id -> (target sequence, its twin, how many of the twin's tokens are the target's)
        self.twins: dict[int, tuple[Sequence, Sequence, int]] = {}

    def _release_finished(self) -> None:
        for seq_id, (target, twin, _) in list(self.twins.items()):
            if target.is_finished:
                self.blocks.free(twin)
                del self.twins[seq_id]

    def finish(self, seq: Sequence) -> None:
        entry = self.twins.pop(seq.seq_id, None)
        if entry is not None:
            self.blocks.free(entry[1])

    def _sync(self, seq: Sequence) -> Sequence:
        """The twin of `seq`, holding seq's tokens, its cache valid up to the first token where
        its old tokens (seq's at the last sync + the drafts since) differ from seq's now."""
        entry = self.twins.get(seq.seq_id)
        if entry is None:
            twin = Sequence(seq.request_id, seq.token_ids)
            self.twins[seq.seq_id] = (seq, twin, len(seq.token_ids))
            return twin
        _, twin, confirmed = entry  # the target's tokens never change: only drafts can differ
        old, new = twin.token_ids, seq.token_ids
        same, limit = confirmed, min(len(old), len(new))
        while same < limit and old[same] == new[same]:
            same += 1
        twin.token_ids = list(new)
        twin.num_computed_tokens = min(twin.num_computed_tokens, same)
        self.twins[seq.seq_id] = (seq, twin, len(new))
        return twin

    follows_grammar = True

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int],
                grammar: DraftGrammar | None = None) -> list[list[int]]:
        """With `grammar`, each draft of a constrained sequence is the argmax among the tokens
        its grammar allows after the drafts before it; a terminated grammar ends its drafts."""
        self._release_finished()
        twins = [self._sync(seq) for seq in seqs]
        out: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            items, rows = [], []
            for i in active:
                if step >= ks[i]:
                    continue
                twin = twins[i]
                new = len(twin.token_ids) - twin.num_computed_tokens
                if not self.blocks.allocate(twin, new):
                    continue  # the draft cache is full: no more drafts for this one
                items.append(ScheduledSequence(twin, new, twin.num_computed_tokens, True))
                twin.num_computed_tokens += new
                rows.append(i)
            if not items:
                break
            with distributed.local():
                logits = self.executor.execute(items)  # [len(items), V]
            if grammar is not None:
                grammar.mask_(logits, rows)
            tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            active = []
            for i, token in zip(rows, tokens):
                if grammar is not None and not grammar.accept(i, token):
                    continue
                twins[i].token_ids.append(token)
                out[i].append(token)
                if grammar is None or not grammar.ended(i):
                    active.append(i)
        return out
