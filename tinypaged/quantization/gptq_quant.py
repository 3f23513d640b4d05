"""The GPTQ algorithm (Frantar et al., 2022): quantize a linear's weight column by column, each
rounding error compensated by the columns not yet quantized.

For a linear y = x W^T (W [N, K]) with calibration inputs X [T, K], the output error of a
quantized W' is ||X (W - W')^T||^2 = sum_n (w_n - w'_n) H (w_n - w'_n)^T with the Hessian
H = 2 X^T X / T [K, K], the same for every output row n. Optimal Brain Quantization: rounding
input column k changes it by e = w[:, k] - q[:, k]; the best update of the columns not yet
quantized (F, those after k) is

    W[:, F] -= (e / Hinv_F[k, k]) Hinv_F[k, F]        Hinv_F = (H restricted to k and F)^-1

GPTQ visits the columns in one fixed order, so all the Hinv_F are rows of one upper Cholesky
factor U of H^-1 (H^-1 = U^T U): row k of U, divided by U[k, k], is the update of step k.
H gets `damp` * mean(diag H) added to its diagonal first (calibration X rarely spans all K
directions). Updates are applied lazily in blocks of 128 columns (the rest of W is touched once
per block). Act-order visits the columns by decreasing diag(H) (the inputs with the largest
activations first, while the most columns are left to absorb their errors); a column's group is
then its position in that order // G, which g_idx records.

Scales and zero points of a group come from the group's columns as they stand when the group's
first column is reached (so they see the compensation so far); scales are rounded to fp16
before rounding the weights, so the checkpoint dequantizes to exactly the weights used here.
"""

from __future__ import annotations

import torch

BLOCK = 128  # columns per lazy update; a multiple of every group size the format allows


def group_params(w: torch.Tensor, bits: int, sym: bool, importance: torch.Tensor | None = None,
                 shrink_steps: int = 20, max_shrink: float = 0.5):
    """Min-max (asym: the range holding 0) or max-abs (sym) scale and zero of each row of
    w [N, G]: (scales fp16-representable [N], zeros [N]).

    With importance [G] (what a unit of rounding error costs in each column) the range is also
    tried shrunk by 1 - max_shrink * i / shrink_steps, i = 1..shrink_steps, and each row keeps
    the range with the smallest sum_k importance_k (w_k - w'_k)^2: clipping a row's largest
    weights makes the step finer for the rest."""
    s, z = _range_params(w, bits, sym, 1.0)
    if importance is None:
        return s, z
    best = _rounding_error(w, s, z, bits, importance)
    for i in range(1, shrink_steps + 1):
        s_i, z_i = _range_params(w, bits, sym, 1 - max_shrink * i / shrink_steps)
        error = _rounding_error(w, s_i, z_i, bits, importance)
        better = error < best
        best = torch.where(better, error, best)
        s, z = torch.where(better, s_i, s), torch.where(better, z_i, z)
    return s, z


def _range_params(w, bits, sym, ratio):
    top = 2**bits - 1
    if sym:
        s = (w.abs().amax(dim=1) * ratio * 2 / top).clamp(min=1e-8).half().float()
        return s, torch.full_like(s, (top + 1) // 2)
    lo, hi = w.amin(dim=1).clamp(max=0) * ratio, w.amax(dim=1).clamp(min=0) * ratio
    s = ((hi - lo) / top).clamp(min=1e-8).half().float()
    return s, (-lo / s).round().clamp(0, top)


def _rounding_error(w, s, z, bits, importance):
    q = (w / s[:, None] + z[:, None]).round().clamp(0, 2**bits - 1)
    return (((q - z[:, None]) * s[:, None] - w).pow(2) * importance).sum(dim=1)  # [N]


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  sym: bool = True, act_order: bool = False, damp: float = 0.01,
                  clip: bool = False):
    """w [N, K], hessian [K, K] -> (q [K, N], zeros [K/G, N], scales fp16 [K/G, N], g_idx [K]),
    ints in 0 .. 2^bits - 1 (pack them with gptq_format.pack_gptq). clip: search each group's
    range (group_params) weighting a column's rounding error by 1 / U[k, k]^2, what GPTQ's own
    step counts it at."""
    if w.device.type != "cpu":
        return _gptq_quantize(w, hessian, bits, group_size, sym, act_order, damp, clip)
    # the column loop runs thousands of small ops: on a CPU, syncing threads for each costs more
    # than it saves, by far on a loaded machine (the threads spin against each other)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq_quantize(w, hessian, bits, group_size, sym, act_order, damp, clip)
    finally:
        torch.set_num_threads(threads)


def _gptq_quantize(w, hessian, bits, group_size, sym, act_order, damp, clip):
    W, H = w.float().clone(), hessian.float().clone()
    N, K = W.shape
    G = K if group_size == -1 else group_size
    if K % G or (G < K and BLOCK % G):
        raise ValueError(f"GPTQ: group_size={group_size} must divide the {K} inputs and "
                         f"{BLOCK}")
    dead = torch.diag(H) == 0  # inputs never active in calibration: their weights don't matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(K, device=H.device)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    importance = U.diagonal().pow(-2) if clip else None  # [K]
    top = 2**bits - 1
    Q = torch.zeros(N, K, dtype=torch.int64, device=W.device)
    scales = torch.empty(K // G, N, device=W.device)
    zeros = torch.empty(K // G, N, device=W.device)
    if G == K:
        scales[0], zeros[0] = group_params(W, bits, sym, importance)
    for b0 in range(0, K, BLOCK):
        b1 = min(b0 + BLOCK, K)
        W1, U1 = W[:, b0:b1].clone(), U[b0:b1, b0:b1]
        errors = torch.zeros_like(W1)
        for i in range(b1 - b0):
            k = b0 + i
            if G < K and k % G == 0:
                scales[k // G], zeros[k // G] = group_params(
                    W1[:, i:i + G], bits, sym, None if importance is None else importance[k:k + G])
            s, z = scales[k // G], zeros[k // G]
            q = (W1[:, i] / s + z).round().clamp(0, top)
            Q[:, k] = q.long()
            e = (W1[:, i] - (q - z) * s) / U1[i, i]
            W1[:, i:] -= e[:, None] * U1[i, i:][None, :]
            errors[:, i] = e
        W[:, b1:] -= errors @ U[b0:b1, b1:]

    q_out = torch.empty(K, N, dtype=torch.int64, device=W.device)
    q_out[perm] = Q.t()
    g_idx = torch.empty(K, dtype=torch.int32, device=W.device)
    g_idx[perm] = (torch.arange(K, device=W.device) // G).to(torch.int32)
    return q_out, zeros.long(), scales.half(), g_idx


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor) -> torch.Tensor:
    """gptq_quantize's outputs -> W' [N, K] = ((q - z[g_idx]) * s[g_idx])^T in fp32."""
    g = g_idx.long()
    return ((q - zeros[g]).float() * scales.float()[g]).t()


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """Mean squared output error of a weight change delta [N, K] on the calibration inputs,
    ||X delta^T||^2 / (T N) = sum(delta H * delta) / (2 N) with H = 2 X^T X / T."""
    return ((delta.float() @ hessian) * delta.float()).sum().item() / (2 * delta.shape[0])


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / T [K, K] of calibration inputs x [T, K], in fp32."""
    x = x.float()
    return 2 * x.t() @ x / x.shape[0]


def rtn_dequantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """Round-to-nearest with group_params, dequantized: the baseline GPTQ improves on [N, K]."""
    N, K = w.shape
    G = K if group_size == -1 else group_size
    groups = w.float().reshape(N * K // G, G)
    s, z = group_params(groups, bits, sym)
    q = (groups / s[:, None] + z[:, None]).round().clamp(0, 2**bits - 1)
    return ((q - z[:, None]) * s[:, None]).reshape(N, K)
