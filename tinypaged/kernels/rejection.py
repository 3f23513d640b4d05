"""The accept/reject walk of speculative decoding: one program per sequence.

A sequence proposed `num_draft[i]` tokens x_0..x_{n-1} (DRAFT[i, :n]); the target scored the n+1
positions in one forward, rows ROW_START[i] .. ROW_START[i] + n of the flat per-position arrays:

    TARGET_PROBS [R, V]  the target's processed distribution p_j (after temperature, top-k, ...)
    DRAFT_PROBS  [R, V]  the proposer's distribution q_j at the same rows (absent for proposers
                         that propose one token with certainty, e.g. n-gram: q_j = onehot(x_j))
    UNIFORM      [R]     u_j ~ U[0, 1)
    RECOVERED    [R]     j < n: a draw from the residual norm(max(p_j - q_j, 0));
                         j = n: a draw from p_n (the bonus token); greedy rows: argmax p_j

Walk, for j = 0, 1, ...: a greedy row accepts x_j when x_j == RECOVERED[j] (the target's argmax);
a random row accepts when u_j * q_j(x_j) <= p_j(x_j), i.e. with probability min(1, p/q) (the
standard rule of Leviathan et al. / Chen et al.: the output then follows p exactly). The first
rejected position emits RECOVERED[j] and stops; when all n are accepted the bonus RECOVERED[n]
follows. OUT[i] [K + 1] gets the emitted tokens, -1 after them.

The per-row data are a few scalars per position, so the walk is a short loop of scalar loads;
the V-wide work (probabilities, residual draws) is done before, batched over every row.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, tl, use_triton


# K (the step's widest draft) is a runtime loop bound, not a constexpr: it takes every value up
# to num_speculative_tokens as proposers return shorter drafts, and each new constexpr value
# compiled the kernel again in the middle of serving.
@jit(do_not_specialize=("vocab_size", "K"))
def _rejection_kernel(
    OUT,  # [N, K + 1] int64, filled with -1 beforehand
    DRAFT,  # [N, K] int64
    NUM_DRAFT,  # [N] int32 or int64
    ROW_START,  # [N] int64
    GREEDY,  # [N] int32 or int64 (1 = greedy)
    TARGET_PROBS,  # [R, V] float32 (unused when ALL_GREEDY)
    DRAFT_PROBS,  # [R, V] float32 (unused unless HAS_DRAFT_PROBS)
    UNIFORM,  # [R] float32 (unused when ALL_GREEDY)
    RECOVERED,  # [R] int64
    vocab_size,
    K,
    HAS_DRAFT_PROBS: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    n = tl.load(NUM_DRAFT + i)
    start = tl.load(ROW_START + i)
    greedy = tl.load(GREEDY + i) != 0
    live = n >= 0  # true: the walk has not stopped yet
    for j in range(K):
        in_draft = j < n
        row = start + j
        x = tl.load(DRAFT + i * K + j, mask=in_draft, other=0)
        rec = tl.load(RECOVERED + row, mask=in_draft, other=0)
        accept = x == rec
        if not ALL_GREEDY:
            p = tl.load(TARGET_PROBS + row * vocab_size + x, mask=in_draft, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(DRAFT_PROBS + row * vocab_size + x, mask=in_draft, other=1.0)
            else:
                q = 1.0
            u = tl.load(UNIFORM + row, mask=in_draft, other=1.0)
            accept = tl.where(greedy, accept, (q > 0.0) & (u * q <= p))
        emit = live & in_draft
        tl.store(OUT + i * (K + 1) + j, tl.where(accept, x, rec), mask=emit)
        live = live & (accept | (j >= n))
    # Every draft accepted: the bonus token at position n.
    bonus = tl.load(RECOVERED + start + n)
    tl.store(OUT + i * (K + 1) + n, bonus, mask=live)


def rejection_sample_triton(
    draft: torch.Tensor, num_draft: torch.Tensor, row_start: torch.Tensor, greedy: torch.Tensor,
    target_probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
    uniform: torch.Tensor, recovered: torch.Tensor,
) -> torch.Tensor:
    """The Triton launcher; see `rejection_sample`."""
    num_seqs, k = draft.shape
    out = torch.full((num_seqs, k + 1), -1, dtype=torch.int64, device=draft.device)
    if num_seqs == 0:
        return out
    if k == 0:  # nothing proposed: the bonus token alone
        out[:, 0] = recovered[row_start]
        return out
    all_greedy = target_probs is None
    probs = recovered if all_greedy else target_probs  # a placeholder pointer when unused
    # Integer inputs are read as they come (the rejection sampler packs them as int64 in one
    # copy): a cast would be one more launch after the forward, which the step waits for.
    if greedy.dtype == torch.bool:
        greedy = greedy.to(torch.int32)
    _rejection_kernel[(num_seqs,)](
        out, draft.contiguous(), num_draft, row_start,
        greedy, probs, probs if draft_probs is None else draft_probs,
        uniform, recovered, 0 if all_greedy else target_probs.shape[1],
        K=k, HAS_DRAFT_PROBS=draft_probs is not None, ALL_GREEDY=all_greedy, num_warps=1,
    )
    return out


def rejection_sample_ref(
    draft: torch.Tensor, num_draft: torch.Tensor, row_start: torch.Tensor, greedy: torch.Tensor,
    target_probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
    uniform: torch.Tensor, recovered: torch.Tensor,
) -> torch.Tensor:
    """The torch reference: the same walk, one Python loop per sequence (reads the host)."""
    num_seqs, k = draft.shape
    out = torch.full((num_seqs, k + 1), -1, dtype=torch.int64, device=draft.device)
    for i in range(num_seqs):
        start, n = int(row_start[i]), int(num_draft[i])
        for j in range(n + 1):
            rec = int(recovered[start + j])
            if j == n:
                out[i, j] = rec
                break
            x = int(draft[i, j])
            if bool(greedy[i]) or target_probs is None:
                accept = x == rec
            else:
                p = float(target_probs[start + j, x])
                q = 1.0 if draft_probs is None else float(draft_probs[start + j, x])
                accept = q > 0.0 and float(uniform[start + j]) * q <= p
            out[i, j] = x if accept else rec
            if not accept:
                break
    return out


def rejection_sample(
    draft: torch.Tensor, num_draft: torch.Tensor, row_start: torch.Tensor, greedy: torch.Tensor,
    target_probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
    uniform: torch.Tensor, recovered: torch.Tensor,
) -> torch.Tensor:
    """Emitted tokens [N, K + 1] (int64, -1 after each row's last) of the accept/reject walk.

    draft [N, K] int64 (entries past num_draft[i] ignored); num_draft [N] int; row_start [N]
    int64: row of position 0 of sequence i in the flat [R] / [R, V] arrays; greedy [N] bool
    or int (1 = greedy); target_probs [R, V] float32 or None when every row is greedy;
    draft_probs [R, V] or None (proposals with certainty); uniform [R] float32 (not read when
    target_probs is None: may be empty); recovered [R] int64 (module docstring)."""
    if draft.dim() != 2 or num_draft.shape != (draft.shape[0],):
        raise ValueError(
            f"draft must be [N, K] and num_draft [N], got {tuple(draft.shape)} and "
            f"{tuple(num_draft.shape)}"
        )
    args = (draft, num_draft, row_start, greedy, target_probs, draft_probs, uniform, recovered)
    if use_triton(draft):
        return rejection_sample_triton(*args)
    return rejection_sample_ref(*args)
