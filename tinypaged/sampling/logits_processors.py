"""What a request adds to its logits besides the sampler's own settings: allowed_token_ids,
bad_words, logit_bias and a structured-output grammar (vLLM's names and semantics).

Per request, once at `add_request` (`LogitsConstraints.build`, which also validates the token
ids against the vocabulary):
- allowed_token_ids -> a packed bit row, bit t set = token t allowed;
- bad_words -> the token ids of each word, tokenized with and without a leading space as vLLM
  does; the word's last token is banned whenever the output ends with the tokens before it (a
  one-token word is always banned);
- logit_bias -> (token, bias) pairs, bias already clamped to [-100, 100];
- structured_outputs -> the compiled grammar and one matcher per sample (structured_output.py).

Per step (`LogitsMaskBuilder.build`, on the CPU while the GPU runs the model), for the sampled
rows that have any of these, one packed int32 bitmask [R, ceil(V / 32)]:

    row = grammar_mask(matcher) & allowed_row & ~banned_bad_word_tokens

plus the bias entries (row, token, bias), each sent to the device in one copy; the sampler
applies them with kernels/logits.py. Rows of unconstrained requests are not in R.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tinypaged.sampling.params import SamplingParams
from tinypaged.sampling.sampler import SamplingBatch


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def clear_bits(words: np.ndarray, token_ids: Sequence[int]) -> None:
    """Clear bit t of `words` (uint32 [W]) for each t: token t is not allowed."""
    for t in token_ids:
        words[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF


def _bad_words_ids(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    # As vLLM: the word as written and with one leading space (how it reads mid-sentence), the
    # second kept when it tokenizes differently but to as many tokens.
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def _check_ids(field_name: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{field_name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})"
        )


@dataclass
class LogitsConstraints:
    """One request's logits constraints (build with `build`; None when it has none)."""

    allowed_words: np.ndarray | None = None  # uint32 [W]: bit t set = token t allowed
    bad_words_ids: list[list[int]] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    matchers: list[Any] = field(default_factory=list)  # one grammar matcher per sample, or []

    @property
    def has_mask(self) -> bool:
        return bool(self.matchers) or self.allowed_words is not None or bool(self.bad_words_ids)

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        vocab_size: int,
        tokenizer: Any,
        grammar_compiler: Callable[[], Any],
    ) -> LogitsConstraints | None:
        """Validate and prepare; raises ValueError naming the field for ids outside the vocab,
        an invalid grammar, or a field that needs a tokenizer when there is none.
        grammar_compiler() returns the engine's GrammarCompiler or GrammarProcess (built on first
        use)."""
        if not (
            params.allowed_token_ids is not None or params.bad_words or params.logit_bias
            or params.structured_outputs is not None
        ):
            return None
        c = cls()
        if params.allowed_token_ids is not None:
            _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
            c.allowed_words = np.zeros(num_words(vocab_size), dtype=np.uint32)
            ids = np.asarray(params.allowed_token_ids, dtype=np.int64)
            np.bitwise_or.at(c.allowed_words, ids >> 5, (1 << (ids & 31)).astype(np.uint32))
        if params.logit_bias:
            _check_ids("logit_bias", list(params.logit_bias), vocab_size)
            c.bias_ids, c.bias_values = list(params.logit_bias), list(params.logit_bias.values())
        if params.bad_words or params.structured_outputs is not None:
            if tokenizer is None:
                what = "bad_words" if params.bad_words else "structured_outputs"
                raise ValueError(f"{what} needs a tokenizer (skip_tokenizer_init is set)")
        if params.bad_words:
            c.bad_words_ids = _bad_words_ids(params.bad_words, tokenizer)
            _check_ids("bad_words", [t for w in c.bad_words_ids for t in w], vocab_size)
        if params.structured_outputs is not None:
            c.matchers = grammar_compiler().matchers(params.structured_outputs, params.n)
        return c

    def banned_tokens(self, output_ids: list[int]) -> list[int]:
        """The bad words' last tokens that may not come next after `output_ids`."""
        banned = []
        for ids in self.bad_words_ids:
            prefix = ids[:-1]
            if not prefix or output_ids[len(output_ids) - len(prefix):] == prefix:
                banned.append(ids[-1])
        return banned


@dataclass
class LogitsMasks:
    """One step's constraints on the device (see kernels/logits.py for the layout)."""

    bitmask_rows: torch.Tensor | None = None  # [R] int64: logits rows with a mask
    bitmask: torch.Tensor | None = None  # [R, W] int32
    bias_rows: torch.Tensor | None = None  # [K] int64
    bias_ids: torch.Tensor | None = None  # [K] int64
    bias_values: torch.Tensor | None = None  # [K] float32


class LogitsMaskBuilder:
    """Builds each step's LogitsMasks; keeps host buffers for the bitmask and its row indices
    (pinned when the device is a GPU, so both copies are asynchronous: a copy from pageable
    memory may wait for the GPU) that grow with the number of constrained rows."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._host = torch.empty((0, num_words(vocab_size)), dtype=torch.int32)
        self._rows = torch.empty((0,), dtype=torch.int64)
        # What fills grammar rows: a structured_output.MaskFiller (made at the first grammar row)
        # or the grammar process (set by the engine), whose matchers live there
        self.filler = None
        # grammar_worker.GrammarWorker (set by the engine): the last step's matchers took their
        # tokens there and filled their next masks, which `build` sends (or copies) unfilled
        self.worker = None

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The bitmask's host rows; `self._rows[:num_rows]` holds as many row indices."""
        if self._host.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            size = max(num_rows, 2 * self._host.shape[0])
            self._host = torch.empty((size, self._host.shape[1]), dtype=torch.int32,
                                     pin_memory=pin)
            self._rows = torch.empty((size,), dtype=torch.int64, pin_memory=pin)
        return self._host[:num_rows]

    def build(
        self, rows: list[tuple[int, LogitsConstraints, int, list[int]]]
    ) -> LogitsMasks | None:
        """rows: (logits row, the request's constraints, sample index, output ids so far) for
        each sampled sequence whose request has constraints. Returns None when nothing applies.
        The previous step's copy has finished (the sampler synchronizes to read its tokens), so
        the host buffers are free to refill."""
        masks = LogitsMasks()
        masked = [r for r in rows if r[1].has_mask]
        if masked:
            host, row_ids = self._buffer(len(masked)), self._rows[: len(masked)]
            row_ids.numpy()[:] = [r[0] for r in masked]
            # the worker's last advance (waited for), read once: then it holds no matchers
            advance = self.worker.take_latest() if self.worker is not None else None
            worker_rows = self._worker_rows(masked, advance)
            if worker_rows is not None:  # the worker's rows as they are: no host copy
                host = worker_rows
            else:
                self._fill(masked, host, advance)
            masks.bitmask = host.to(self.device, non_blocking=True)
            masks.bitmask_rows = row_ids.to(self.device, non_blocking=True)
        entries = [
            (row, t, b) for row, c, _, _ in rows if c.bias_ids
            for t, b in zip(c.bias_ids, c.bias_values)
        ]
        return self._finish(masks, entries)

    def _worker_rows(self, masked: list[tuple[int, LogitsConstraints, int, Any]],
                     advance: Any) -> torch.Tensor | None:
        """The worker's last bitmask [R, W] (`advance`'s) when its rows are this step's mask as
        they stand: every masked row a grammar alone (no allowed_token_ids or bad_words to
        combine), the worker's matchers these rows' matchers in their order (the steady state of
        a decode batch). Else None."""
        if advance is None or len(advance.live) != len(masked):
            return None
        for (_, c, index, _), m in zip(masked, advance.live):
            if not c.matchers or c.matchers[index] is not m() or c.allowed_words is not None \
                    or c.bad_words_ids:
                return None
        return advance.bitmask[: len(masked)]

    def _fill(self, masked: list[tuple[int, LogitsConstraints, int, Any]],
              host: torch.Tensor, advance: Any = None) -> None:
        """Each masked row's mask into its row of `host` [R, W]: the grammar's, and'ed with
        allowed_token_ids, less the banned bad words."""
        words = host.numpy().view(np.uint32)  # the same memory, bit ops without sign
        grammar = [(i, c.matchers[index]) for i, (_, c, index, _) in enumerate(masked)
                   if c.matchers]
        if grammar:
            self._fill_grammar(grammar, host, advance)
        others = [(i, c, out) for i, (_, c, _, out) in enumerate(masked)
                  if not c.matchers or c.allowed_words is not None or c.bad_words_ids]
        for i, c, output_ids in others:
            if not c.matchers:
                words[i] = 0xFFFFFFFF
            if c.allowed_words is not None:
                words[i] &= c.allowed_words
            if c.bad_words_ids:
                clear_bits(words[i], c.banned_tokens(output_ids))

    def _fill_grammar(self, grammar: list[tuple[int, Any]], host: torch.Tensor,
                      advance: Any) -> None:
        """The host rows of the grammar rows (host row, matcher): copied from the worker's last
        `advance` where it filled the matcher's next mask (every row, once decoding runs), the
        others filled in one call (`self.filler`)."""
        worker_rows = advance.rows if advance is not None else {}
        if worker_rows:
            src = [worker_rows.get(id(m), -1) for _, m in grammar]
            if len(grammar) == host.shape[0] and -1 not in src:  # rows 0.. in order: one copy
                torch.index_select(advance.bitmask, 0, torch.tensor(src), out=host)
                return
            fresh = [(i, j) for (i, _), j in zip(grammar, src) if j >= 0]
            if fresh:
                host[[i for i, _ in fresh]] = advance.bitmask[[j for _, j in fresh]]
            grammar = [(i, m) for (i, m), j in zip(grammar, src) if j < 0]
        if grammar:
            if self.filler is None:
                from tinypaged.sampling.structured_output import MaskFiller
                self.filler = MaskFiller()
            self.filler.fill([m for _, m in grammar], host, [i for i, _ in grammar])

    def _finish(self, masks: LogitsMasks,
                entries: list[tuple[int, int, float]]) -> LogitsMasks | None:
        """`masks` with the logit-bias entries (row, token id, bias) on the device, in one
        copy; None when the step has neither a mask nor a bias."""
        if entries:
            packed = torch.tensor(entries, dtype=torch.float64).to(self.device, non_blocking=True)
            masks.bias_rows, masks.bias_ids = packed[:, 0].long(), packed[:, 1].long()
            masks.bias_values = packed[:, 2].float()
        if masks.bitmask is None and masks.bias_rows is None:
            return None
        return masks


def step_sampling_batch(seqs: Sequence[Any], reqs: Sequence[Any], builder: LogitsMaskBuilder,
                        eos_token_ids: frozenset[int], device: torch.device,
                        read_histories: bool) -> SamplingBatch:
    """The SamplingBatch of an engine step's sampled rows: `seqs` (scheduler Sequences) and
    their requests `reqs` (the engine's RequestStates: params, generators, constraints), with
    the constrained rows' masks from `builder` (not for a row whose sequence the previous step
    ended: its token is dropped). Token histories are read only by penalties and min_tokens:
    without `read_histories` (no live request has either) none is copied."""
    masks = builder.build([  # the output so far only for bad_words (a copy of the list)
        (row, r.constraints, s.index, s.output_token_ids if r.constraints.bad_words_ids else ())
        for row, (r, s) in enumerate(zip(reqs, seqs))
        if r.constraints is not None and s.finish_reason is None
    ])
    if read_histories:
        needs = {id(r.params): r.params.uses_penalties or r.params.min_tokens > 0 for r in reqs}
        hist = [needs[id(r.params)] for r in reqs]
        prompts = [s.prompt_token_ids if h else () for s, h in zip(seqs, hist)]
        outputs = [s.output_token_ids if h else () for s, h in zip(seqs, hist)]
    else:
        prompts = outputs = [()] * len(seqs)
    batch = SamplingBatch.build(
        [r.params for r in reqs], prompts, outputs,
        [r.generators[s.index] for r, s in zip(reqs, seqs)], eos_token_ids, device,
    )
    batch.logits_masks = masks
    return batch
