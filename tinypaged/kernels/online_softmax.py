"""Online softmax: the recurrence both attention kernels stream keys through.

Attention of one query row over keys j = 1..n with scores s_j and values v_j is

    o = sum_j e^{s_j} v_j / sum_j e^{s_j}

and the kernels see the keys one tile at a time, never all n scores at once. They keep three
running values per row over the keys seen so far (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; FlashAttention-2, Dao 2023, arXiv 2307.08691, Algorithm 1):

    m   = max_j s_j                      the running max
    l   = sum_j e^{s_j - m}              the running sum, relative to m
    acc = sum_j e^{s_j - m} v_j          the unnormalized output, relative to m

A new tile T brings scores s_j, j in T. The max may grow, m' = max(m, max_{j in T} s_j), and
what was summed relative to m is re-expressed relative to m' by one factor per row,
alpha = e^{m - m'} (<= 1), since e^{s - m} * e^{m - m'} = e^{s - m'}:

    p_j  = e^{s_j - m'}                  j in T
    l'   = alpha * l   + sum_{j in T} p_j
    acc' = alpha * acc + sum_{j in T} p_j v_j          (a tl.dot of p [M, N] with V [N, D])

and at the end o = acc / l: one division per row, not per tile (FlashAttention-2's change to the
original FlashAttention). Subtracting the max is what keeps this finite: every exponent is <= 0,
so nothing overflows (e^x overflows fp32 for x > 88.7), and the largest term is exactly 1, so l
cannot underflow to 0 while a key is visible.

Base 2: e^x = 2^{x log2(e)}. The kernels fold log2(e) into the softmax scale once, so scores
arrive already in base 2 and every exponential is one `exp2` (a single hardware instruction);
m and lse below are then in base 2 too.

Masked keys have score -inf and weigh 0. A row that has seen only masked keys has m = -inf, and
-inf - (-inf) is NaN, so the update subtracts 0 instead of m' while m' is still -inf: p and alpha
are then exp2(-inf) = 0 and l stays 0; `finish` divides by 1 for such rows (output 0).

Split-KV ("Flash-Decoding", Dao, Haziza, Massa, Sizov 2023): a decode row's keys are cut into S
ranges that separate programs reduce in parallel; each returns its own o_s = acc_s / l_s and its
log-sum-exp lse_s = m_s + log2(l_s) (= log2 sum_{j in s} 2^{s_j}). The same max trick merges
them: with M = max_s lse_s,

    o = sum_s 2^{lse_s - M} o_s / sum_s 2^{lse_s - M}

(without M, a split whose scores reach ~128 in base 2 overflows 2^lse to inf and o to NaN).
"""

from __future__ import annotations

from tinypaged.kernels._triton import jit, tl


@jit
def online_softmax_update(m_i, l_i, s):
    """One tile: s [M, N] base-2 scores (-inf where masked), m_i / l_i [M] running max and sum.
    Returns (p [M, N], alpha [M], m_new, l_new); the caller updates acc = acc * alpha + p @ V."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2 gives 0s
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@jit
def online_softmax_finish(acc, l_i):
    """o = acc / l per row [M, D]; 0 for a row that saw no visible key (l = 0)."""
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@jit
def log_sum_exp(m_i, l_i):
    """log2 of sum_j 2^{s_j} from the running state; -inf when no key was visible."""
    return m_i + tl.log2(l_i)


@jit
def merge_splits(lse, o):
    """Merge S partial results of one row: lse [S] (-inf for empty splits), o [S, D] -> [D]."""
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    total = tl.sum(weight, 0)
    return tl.sum(weight[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
