"""The searches behind `tinypaged quantize` (AWQ): round-to-nearest int4 with zero points, the
per-channel scale search and the per-group clip search, on tensors only (no model in sight).

Round-to-nearest per group of G input channels, with zero points (AutoAWQ's convention, the range
widened to hold 0):
    scale = (max - min) / 15,   zero = round(-min / scale),
    q = clamp(round(w / scale) + zero, 0, 15),   w ~ (q - zero) * scale

Activation-aware scaling: y = x W^T = (x / s) (W * s)^T, x [T, K], W [N, K], one factor per
input channel, s = mean_t |x[t, :]|^alpha with alpha searched on a grid in [0, 1) for the smallest
output error of the quantized linears (alpha = 0 is plain round-to-nearest).
"""

from __future__ import annotations

import torch

from tinypaged.kernels.awq import pack_awq

_MAX_LOSS_TOKENS = 8192  # rows of x used to score each alpha; the channel means use all rows


# ---------------------------------------------------------------------------- round-to-nearest
def _group_ranges(w: torch.Tensor, group_size: int, clip: torch.Tensor | None):
    """w [N, K] -> groups [N, K/G, G], zeros [N, K/G], scales [N, K/G] (fp32 holding fp16)."""
    N, K = w.shape
    if K % group_size or N % 8:
        raise ValueError(f"cannot quantize a weight of shape {list(w.shape)} with group_size="
                         f"{group_size}: in_features must be a multiple of the group size and "
                         f"out_features a multiple of 8")
    groups = w.float().reshape(N, K // group_size, group_size)
    # the range always holds 0, so the zero point lands in 0..15 and the grid covers every weight
    # (the same as AutoAWQ's rule for the usual groups that straddle 0)
    w_max, w_min = groups.amax(dim=-1).clamp_(min=0), groups.amin(dim=-1).clamp_(max=0)
    if clip is not None:  # shrink the range toward 0; weights outside it saturate at 0 or 15
        w_max, w_min = w_max * clip, w_min * clip
    # round the scales to fp16 first: the checkpoint stores fp16, and q must fit the stored scale
    scales = ((w_max - w_min).clamp_(min=1e-5) / 15).half().float()
    zeros = (-w_min / scales).round_().clamp_(0, 15)
    return groups, zeros, scales


def _round_to_nearest(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """w [N, K] -> q [N, K], zeros [N, K/G], scales [N, K/G]; clip [N, K/G] optional."""
    groups, zeros, scales = _group_ranges(w, group_size, clip)
    q = (groups / scales[..., None]).round_().add_(zeros[..., None]).clamp_(0, 15)
    return q.reshape(w.shape), zeros, scales


def fake_quantize(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """The weights [N, K] as the int4 checkpoint will reproduce them (fp32)."""
    groups, zeros, scales = _group_ranges(w, group_size, clip)
    # (clamp(round(w / s) + z, 0, 15) - z) * s, in three in-place passes: the searches call this
    # a few hundred times per layer
    q = (groups / scales[..., None]).round_()
    q = torch.clamp_(q, min=-zeros[..., None], max=15 - zeros[..., None])
    return q.mul_(scales[..., None]).reshape(w.shape)


def quantize_rtn(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """w [N, K] -> AutoAWQ tensors (qweight int32 [K, N/8], qzeros int32 [K/G, N/8],
    scales fp16 [K/G, N])."""
    q, zeros, scales = _round_to_nearest(w, group_size, clip)
    qweight, qzeros = pack_awq(q.t().to(torch.int32), zeros.t().to(torch.int32))
    return qweight, qzeros, scales.t().contiguous().half()


# ---------------------------------------------------------------------------- scale search
def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int,
                  n_grid: int = 20, kv_heads: tuple[int, int, int] | None = None):
    """Per-channel factors s [K] for linears `weights` ([N_i, K] each) reading x [T, K].

    kv_heads = (num_kv_heads, queries_per_kv, head_dim) ties s across the query heads that share
    a KV head (o_proj under GQA). Returns (s, info) with info = {alpha, error, rtn_error}: the
    mean squared output error of the best alpha and of alpha = 0 (plain round-to-nearest)."""
    x = x.float()
    x_mean = x.abs().mean(dim=0)  # [K]
    if kv_heads is not None:
        kv, rep, d = kv_heads
        x_mean = x_mean.view(kv, rep, d).mean(dim=1, keepdim=True).expand(kv, rep, d).reshape(-1)
    if x.shape[0] > _MAX_LOSS_TOKENS:  # evenly spaced rows keep every calibration sample
        x = x[torch.linspace(0, x.shape[0] - 1, _MAX_LOSS_TOKENS, device=x.device).long()]
    w = torch.cat([w.float() for w in weights])  # [sum N_i, K]: one matmul per alpha
    ref = x @ w.t()  # [T, sum N_i]
    best = (float("inf"), 0.0, torch.ones_like(x_mean))
    rtn_error = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the factors around 1 (scale-free otherwise)
        out = (x / s) @ fake_quantize(w * s, group_size).t()
        error = torch.nn.functional.mse_loss(out, ref).item()
        rtn_error = error if i == 0 else rtn_error
        if error < best[0]:
            best = (error, alpha, s)
    return best[2], {"alpha": best[1], "error": best[0], "rtn_error": rtn_error}


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """Per (output row, group) range factors clip [N, K/G] in [1 - max_shrink, 1] for w [N, K].

    Clipping a group's few largest weights makes the step finer for all the others. Each group's
    share of the output error, sum_t (x[t, g] . d[n, g])^2 = d[n, g]^T C_g d[n, g] with
    d = w - fake_quantize(w) and C_g = x[:, g]^T x[:, g] [G, G], is minimized on its own."""
    N, K = w.shape
    xg = x.float().reshape(-1, K // group_size, group_size)  # [T, K/G, G]
    gram = torch.einsum("tgi,tgj->gij", xg, xg)  # [K/G, G, G]
    groups = w.float().reshape(N, K // group_size, group_size)
    w_max, w_min = groups.amax(dim=-1).clamp_(min=0), groups.amin(dim=-1).clamp_(max=0)
    best_error = torch.full((N, K // group_size), float("inf"), device=w.device)
    best = torch.ones_like(best_error)
    for i in range(n_grid):
        ratio = 1 - max_shrink * i / n_grid
        # fake_quantize(w, clip=ratio) - w, the group statistics computed once above
        hi, lo = w_max * ratio, w_min * ratio
        scales = ((hi - lo).clamp_(min=1e-5) / 15).half().float()
        zeros = (-lo / scales).round_().clamp_(0, 15)[..., None]
        d = (groups / scales[..., None]).round_().clamp_(min=-zeros, max=15 - zeros)
        d = d.mul_(scales[..., None]).sub_(groups)  # [N, K/G, G]
        error = (torch.einsum("ngi,gij->ngj", d, gram) * d).sum(dim=-1)  # [N, K/G]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better, ratio, best)
    return best
