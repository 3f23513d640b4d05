"""The proposer of the draft heads (EAGLE-3, EAGLE, MTP: heads.py), on a paged KV cache of its
own, in two halves around the target's step:

    observe(items, tokens)   right after the target verified a step (SpecDecoder.launch): the
                             head computes, for every sequence of the step, the positions the
                             target just computed and kept (prompt chunks, the accepted drafts
                             and the bonus token's predecessor), with the target's own hidden
                             states as features (`target.aux_hidden_states`, which the forward
                             keeps for these heads only). Its last row gives draft 1.
    propose(seqs, ks)        before the next schedule(): k - 1 more head steps per sequence,
                             each feeding the head's own output hidden state and the draft it
                             just made.

Each sequence has a twin (a `Sequence` in this proposer's BlockManager) whose token_ids are the
target's shifted by one (position i's input token is token i + 1) and whose cache holds, for
positions below `confirmed`, rows computed from the target's features. The drafting steps write
rows past `confirmed` and are forgotten afterwards (rolled back: the next observe overwrites
them with the target's features). Rows below `confirmed` never change (the tokens do not), so a
sequence the target recomputes after preemption costs the head nothing. The head's cache has a
prefix cache of its own, its blocks named by the twin's (shifted) tokens: a new sequence takes
the rows of its longest cached prefix; positions neither cache had computed by the head (the
target's prefix-cache hit that the head's cache no longer holds) get zero features, which only
lowers acceptance. Draft tokens are the head's argmax (greedy drafts, q = onehot: the rejection
sampler keeps the target's distribution for sampled requests too).

Structured output (and allowed_token_ids, bad_words, logit_bias) inside drafts: observe keeps the
logits of draft 1 rather than its argmax, because the grammar's state after the target's token is
known only once the engine's stop checks have taken that token, before propose. propose then
takes each draft of a constrained sequence as the argmax of the head's logits masked by the
grammar after the drafts before it (grammar.py's DraftGrammar: the matcher walks the drafts and
is rolled back afterwards), so a head drafts where the grammar forces a token even when its own
guess is wrong, and its drafts are never cut.

The drafting steps (one token per sequence) replay a CUDA graph of the head's forward per batch
size on a GPU that captures graphs (worker/cuda_graphs.py's HeadStepGraphs); `_decode_step` is
the one place that picks graph or eager, and batches larger than the largest bucket (and the
CPU) run eagerly. observe's steps (several rows per sequence) always run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from tinypaged.kernels._triton import kernel_choice
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.layers import Attention
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.scheduler.block_manager import BlockManager
from tinypaged.spec_decode.config import SpeculativeConfig
from tinypaged.spec_decode.grammar import DraftGrammar
from tinypaged.spec_decode.head_config import read_head_config
from tinypaged.spec_decode.heads import load_head
from tinypaged.spec_decode.proposers import Proposer
from tinypaged.worker.input_batch import HostBlockTables, build_step

logger = logging.getLogger(__name__)


@dataclass
class _Twin:
    target: Sequence
    seq: Sequence  # token_ids = target's [1:] (+ drafts while proposing)
    confirmed: int = 0  # positions [0, confirmed) hold rows of the target's features
    next_logits: torch.Tensor | None = None  # [draft_vocab]: draft 1's, from the last row
    next_hidden: torch.Tensor | None = None  # [hidden]: the features of draft 2's step


class HeadProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, engine: Any) -> None:
        ex, cfg = engine.executor, engine.config
        self.target = ex.model
        head_config = read_head_config(config.method, config.model, ex.model_dir, ex.hf_config)
        self.head = load_head(head_config, self.target, engine.device, engine.dtype)
        self.device = engine.device
        self.block_size = cfg.block_size
        num_blocks = engine.runner.kv_cache_info.num_blocks
        shape = (num_blocks, cfg.block_size, self.head.num_kv_heads, self.head.head_dim)
        for layer in self.head.modules():
            if isinstance(layer, Attention):
                layer.k_cache = torch.zeros(shape, dtype=engine.dtype, device=self.device)
                layer.v_cache = torch.zeros(shape, dtype=engine.dtype, device=self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.tables = HostBlockTables(cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size) + 1)
        self.kernels = kernel_choice(cfg.kernels)
        self.twins: dict[int, _Twin] = {}
        self.vocab_size = engine.vocab_size
        self.graphs = None
        if engine.runner.graphs is not None:  # the target's decode replays graphs: so do these
            self.graphs = self._capture(cfg.max_num_seqs, engine.dtype)

    def _capture(self, max_batch_size: int, dtype: torch.dtype):
        from tinypaged.worker.cuda_graphs import HeadStepGraphs

        try:
            with self.kernels:
                return HeadStepGraphs(self.head, max_batch_size, self.tables.array.shape[1],
                                      self.block_size, self.head.spec.hidden_size, self.device,
                                      dtype)
        except Exception:
            logger.exception("speculative decoding: capturing the draft head's CUDA graphs "
                             "failed; its drafting steps run eagerly")
            return None

    # ------------------------------------------------------------------ bookkeeping
    def finish(self, seq: Sequence) -> None:
        twin = self.twins.pop(seq.seq_id, None)
        if twin is not None:
            self.blocks.free(twin.seq)

    def _release_finished(self) -> None:
        for twin in [t for t in self.twins.values() if t.target.is_finished]:
            self.finish(twin.target)

    def _run(self, items: list[ScheduledSequence], features: torch.Tensor):
        """One head forward over the twins' rows, eagerly; -> (logits [S, draft_vocab], next
        features [S, H]) of each item's last row."""
        step = build_step(items, self.block_size, self.tables)

        def to(array):
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        md = AttentionMetadata(slot_mapping=to(step.slot_mapping),
                               query_start_loc=to(step.query_start_loc),
                               seq_lens=to(step.seq_lens), block_tables=to(step.block_tables),
                               max_query_len=step.max_query_len, max_seq_len=step.max_seq_len)
        with self.kernels:
            return self.head(to(step.input_ids), to(step.positions), md, features,
                             to(step.logits_indices))

    def _decode_step(self, items: list[ScheduledSequence], features: torch.Tensor):
        """A drafting step (one new row per item; features [S, H]) -> as _run: the captured
        graph of its batch size where there is one, else eagerly. The graph's outputs are its
        static buffers, read (by _pick's sync) before the next replay overwrites them."""
        if self.graphs is None or not self.graphs.fits(len(items)):
            return self._run(items, features)
        step = build_step(items, self.block_size, self.tables)
        with self.kernels:
            return self.graphs.run(step, features)

    def _pick(self, logits: torch.Tensor, rows: list[int],
              grammar: DraftGrammar | None) -> list[int | None]:
        """The draft (a target id) of each row of logits [N, draft_vocab], row r drafting for
        sequence rows[r]: the argmax, or for a constrained sequence the argmax among what its
        grammar allows after its drafts so far (None: nothing allowed is in the head's
        vocabulary, or its grammar has ended); the grammar takes each draft."""
        if grammar is None or all(grammar.entries[i] is None for i in rows):
            return self.head.to_target_ids(logits.argmax(dim=-1)).tolist()
        full = self.head.target_logits(logits, self.vocab_size)  # [N, >= vocab]
        grammar.mask_(full, rows)
        best, ids = full[:, : self.vocab_size].max(dim=-1)
        return [t if b != float("-inf") and grammar.accept(i, t) else None
                for i, b, t in zip(rows, best.tolist(), ids.tolist())]

    # ------------------------------------------------------------------ after the target's step
    @torch.inference_mode()
    def observe(self, items: Seq[ScheduledSequence], tokens: dict[int, list[int]]) -> None:
        self._release_finished()
        aux = self.target.aux_hidden_states  # [T, D]: this step's rows, in `items` order
        features = self.head.combine(aux)  # [T, hidden]
        batch, feats, twins, row = [], [], [], 0
        for it in items:
            seq, q, start = it.seq, it.num_new_tokens, it.num_computed_tokens
            rows, row = features[row : row + q], row + q
            if seq.is_finished:  # ended while this step ran (async scheduling): no twin
                continue
            new = tokens.get(seq.seq_id)  # accepted drafts + the target's token, if sampled
            valid = q if new is None else q - (len(it.spec_token_ids) + 1 - len(new))
            end = start + valid  # the target's features are good for positions [start, end)
            shifted = (seq.token_ids + (new or []))[1:]  # the input of position i: token i+1
            twin = self.twins.get(seq.seq_id) or self._new_twin(seq, shifted)
            # The twin's rows below `confirmed` stay valid (the tokens never change): a
            # recompute after preemption is skipped, a prefix-cache hit of the target that the
            # head's cache did not have gets zero features.
            first = twin.confirmed
            twin.seq.token_ids = shifted
            if end <= first:
                continue
            twin.next_logits = None
            if not self.blocks.allocate(twin.seq, end - first):
                self.finish(seq)  # the head's cache is full: this sequence drafts nothing
                continue
            gap = rows.new_zeros(max(0, start - first), rows.shape[1])
            feats.append(torch.cat([gap, rows[max(0, first - start) : valid]]))
            batch.append(ScheduledSequence(twin.seq, end - first, first, True))
            twin.seq.num_computed_tokens = twin.confirmed = end
            twins.append(twin)
        if not batch:
            return
        logits, hidden = self._run(batch, torch.cat(feats))
        for i, twin in enumerate(twins):
            twin.next_logits, twin.next_hidden = logits[i], hidden[i]
            self.blocks.mark_computed(twin.seq)  # full blocks of the target's features only

    def _new_twin(self, seq: Sequence, shifted: list[int]) -> _Twin:
        """A twin taking the longest prefix its cache holds (its blocks are named by the shifted
        tokens, so a block's hash covers every token its rows depend on)."""
        twin_seq = Sequence(seq.request_id, shifted or [0])
        twin_seq.lora_int_id = seq.lora_int_id  # another adapter: other features
        hits = self.blocks.find_cached_prefix(twin_seq)
        if hits:
            self.blocks.allocate(twin_seq, 0, hits)
        twin = self.twins[seq.seq_id] = _Twin(seq, twin_seq, twin_seq.num_computed_tokens)
        return twin

    # ------------------------------------------------------------------ before the next one
    follows_grammar = True

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int],
                grammar: DraftGrammar | None = None) -> list[list[int]]:
        """Draft 1 from the logits observe kept, then a head step per further draft; with
        `grammar`, each draft of a constrained sequence follows its grammar (_pick)."""
        self._release_finished()
        out: list[list[int]] = [[] for _ in seqs]
        live: dict[int, _Twin] = {}  # index in seqs -> its twin, while it drafts
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            twin = self.twins.get(seq.seq_id)
            if (k > 0 and twin is not None and twin.next_logits is not None
                    and twin.confirmed == len(seq.token_ids) - 1):
                live[i] = twin
        rows = list(live)
        logits = torch.stack([live[i].next_logits for i in rows]) if rows else None
        features = {i: twin.next_hidden for i, twin in live.items()}
        while rows:
            drafting = []
            for i, token in zip(rows, self._pick(logits, rows, grammar)):
                if token is None:
                    continue  # nothing the grammar allows: no more drafts for this one
                out[i].append(token)
                if len(out[i]) < ks[i] and not (grammar is not None and grammar.ended(i)):
                    drafting.append(i)
            batch, rows = [], []
            for i in drafting:
                twin = live[i]
                s, position = twin.seq, twin.confirmed + len(out[i]) - 1
                s.token_ids.append(out[i][-1])  # the input of `position` is the last draft
                s.num_computed_tokens = position
                if not self.blocks.allocate(s, 1):
                    continue  # the head's cache is full: no more drafts for this one
                batch.append(ScheduledSequence(s, 1, position, True))
                s.num_computed_tokens = position + 1
                rows.append(i)
            if not batch:
                break
            logits, hidden = self._decode_step(batch, torch.stack([features[i] for i in rows]))
            for j, i in enumerate(rows):
                features[i] = hidden[j]
        for twin in live.values():  # forget the drafts' rows: the target's features replace them
            twin.seq.num_computed_tokens = twin.confirmed
            del twin.seq.token_ids[twin.confirmed :]
        return out
