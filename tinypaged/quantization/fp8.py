"""FP8 (e4m3) linear layers: FP8 checkpoints, and bf16 / fp16 checkpoints quantized at load.

Four ways in, one linear method (`Fp8Config`), as vLLM reads them:

- `quant_method: "fp8"` with per-tensor scales (AutoFP8, vLLM / HF "fp8" checkpoints):
  `weight` float8_e4m3fn [N, K], `weight_scale` one fp32 per tensor (per shard of a fused
  layer), `input_scale` one per tensor when `activation_scheme` is "static";
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (Qwen3-*-FP8, DeepSeek-V3):
  `weight_scale_inv` fp32 [N/128, K/128], one scale per block (the name notwithstanding, the
  weight is q * weight_scale_inv); activations quantized per token and group of 128 inputs;
- `quant_method: "compressed-tensors"`, format "float-quantized" (llm-compressor's FP8 and
  FP8_DYNAMIC): `weight_scale` [N, 1] per channel (or one per tensor), activations per token
  (dynamic) or per tensor (static `input_scale`);
- a dense checkpoint with `quantization="fp8"` (`--quantization fp8`): each weight is
  quantized at load with one scale per output channel, activations per token (vLLM's online
  FP8).

A per-tensor weight scale is widened to per channel when it loads (each shard of a fused q/k/v
or gate/up layer fills its own rows), so per-tensor and per-channel weights run one kernel. A
static `input_scale` is kept per layer, the largest of a fused layer's shards (as vLLM).

apply(): on CUDA (or under TRITON_INTERPRET=1) W8A8, kernels/fp8.py: the activations are
quantized (per token, per token group, or with the static scale) and the FP8 GEMM multiplies
them by the FP8 weights, fp32 accumulators, the scales applied in the GEMM; at 2-16 rows
kernels/fp8_rows.py instead (split over K, the weight in the MMA's wide slot;
$TINYPAGED_FP8_ROWS=0 keeps fp8_gemm there: w8a8_product). At decode the kernels/dense_gemv.py
GEMV instead, one launch, in one of two modes ($TINYPAGED_FP8_GEMV): "w8a16" (the default; one
row for now: kernels/dense_gemv.py says why) streams the e4m3 weight, converts it in registers
and multiplies it by the activations as they are; "w8a8dot" (1-16 rows) quantizes each K step
of the activations to e4m3 in registers (one scale per row and step) and multiplies on FP8
tensor cores. A static input_scale is unused by both. Where the decoder layer's RMSNorm or
SiLU-and-mul comes before the W8A8 product, that kernel quantizes x in its own pass instead
(fp8_norm_linear, fp8_silu_and_mul_down). On the CPU
the weights are dequantized and multiplied in the activations' dtype (weight-only FP8, as
vLLM's fallback on GPUs without FP8 tensor cores): the fp32 CPU path is then exactly the
checkpoint's dequantized model, which is what the tests compare with transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinypaged.distributed.parallel_state import all_reduce
from tinypaged.kernels._triton import use_triton
from tinypaged.kernels.dense_gemv import (
    FP8_GEMV_MAX_M,
    dense_gemv,
    fp8_gemv_config,
    fp8_gemv_mode,
    gemv_enabled,
)
from tinypaged.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_gemm, quantize_fp8
from tinypaged.kernels.fp8_act import silu_and_mul_quant_fp8
from tinypaged.kernels.fp8_rows import fp8_rows, fp8_rows_config, fp8_rows_enabled
from tinypaged.kernels.norm import rms_norm_quant_fp8
from tinypaged.quantization.base import QuantizationMethod

SUPPORTED_BLOCKS = ((128, 128),)
# layers a checkpoint may leave unquantized that are not quantized linears here anyway
_UNQUANTIZED_OK = ("lm_head", "gate")  # "gate": MoE routers (and shared_expert_gate)


def _check_ignored(ignored, what: str) -> None:
    names = [n for n in (ignored or [])  # names, or compressed-tensors' "re:.*mlp.gate$"
             if not str(n).removeprefix("re:").rstrip("$").split(".")[-1]
             .endswith(_UNQUANTIZED_OK)]
    if names:
        shown = ", ".join(map(str, names[:4]))
        raise ValueError(f"FP8 checkpoint with {what} [{shown}{' ...' if len(names) > 4 else ''}]"
                         ": mixing dense and FP8 linears is not supported")


@dataclass(frozen=True)
class Fp8Config(QuantizationMethod):
    name: ClassVar[str] = "fp8"
    weight_scheme: str = "channel"  # "tensor" | "channel" | "block"
    static_input: bool = False  # activations scaled by the checkpoint's input_scale
    block: tuple[int, int] | None = None  # (N, K) of a weight scale block
    from_dense: bool = False  # quantize a bf16 / fp16 checkpoint's weights at load

    @classmethod
    def from_config(cls, quantization_config: dict) -> Fp8Config:
        """From config.json's `quantization_config` ({"quant_method": "fp8", ...})."""
        q = cls.own_config(quantization_config)
        fmt = str(q.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"FP8 checkpoint with fmt={fmt!r}: tinypaged runs e4m3 weights")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {scheme!r}: expected 'dynamic' or 'static'")
        _check_ignored(q.get("ignored_layers") or q.get("modules_to_not_convert"),
                       "ignored_layers")
        block = q.get("weight_block_size")
        if block is None:
            return cls(weight_scheme="tensor", static_input=scheme == "static")
        block = tuple(int(b) for b in block)
        if block not in SUPPORTED_BLOCKS:
            raise ValueError(f"FP8 weight_block_size {list(block)}: tinypaged runs "
                             f"{[list(b) for b in SUPPORTED_BLOCKS]}")
        if scheme != "dynamic":
            raise ValueError("block-wise FP8 checkpoints need activation_scheme 'dynamic'")
        return cls(weight_scheme="block", block=block)

    @classmethod
    def online(cls) -> Fp8Config:
        """`quantization="fp8"` on a dense checkpoint: per-channel weights, per-token inputs."""
        return cls(weight_scheme="channel", from_dense=True)

    # ------------------------------------------------------------------ weights

    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register the weight (fp8, or the dense one to quantize) and its scales on `layer`."""
        N, K = output_size_per_partition, input_size
        dtype = params_dtype if self.from_dense else FP8_DTYPE
        weight = nn.Parameter(torch.empty(N, K, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        if self.from_dense:
            return
        if self.weight_scheme == "block":
            bn, bk = self.block
            _check_blocks(layer, K, bn, bk)
            scale = torch.empty(-(-N // bn), -(-K // bk), dtype=torch.float32)
            param = nn.Parameter(scale, requires_grad=False)
            param.output_dim, param.input_dim, param.packed_factor = 0, 1, bn
            layer.register_parameter("weight_scale_inv", param)
        elif self.weight_scheme == "channel":
            param = nn.Parameter(torch.empty(N, 1, dtype=torch.float32), requires_grad=False)
            param.output_dim = 0
            layer.register_parameter("weight_scale", param)
        else:
            param = nn.Parameter(torch.empty(N, 1, dtype=torch.float32), requires_grad=False)
            param.weight_loader = _per_tensor_scale_loader(layer)
            layer.register_parameter("weight_scale", param)
        if self.static_input:
            param = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)
            param.weight_loader = _max_scale_loader
            layer.register_parameter("input_scale", param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize a dense weight (online), and name the weight scales `weight_scale`."""
        if self.from_dense:
            w = layer.weight.data
            scale = (w.float().abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            del layer.weight, w
            layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
            layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        elif self.weight_scheme == "block":
            scale = layer.weight_scale_inv.data
            del layer.weight_scale_inv
            layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer computes with, [N, K] fp32 (the CPU path; tests)."""
        return dequantize_fp8(layer.weight, layer.weight_scale, self.block)

    # ------------------------------------------------------------------ apply

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., N] = x [..., K] @ W^T + bias: W8A8 through kernels/fp8.py where the Triton
        kernels run, else the dequantized weights in x's dtype (module docstring)."""
        x2 = x.reshape(-1, x.shape[-1])
        mode = fp8_gemv_mode()
        if use_triton(x2) and self.takes_gemv(x2, mode):
            y = dense_gemv(x2, layer.weight, bias, layer.weight_scale, self.block,
                           **fp8_gemv_config(x2.shape[0], self.block, mode,
                                             layer.weight.shape[0]))
            return y.reshape(*x.shape[:-1], -1)
        if use_triton(x2):
            if self.weight_scheme == "block":
                q, s = quantize_fp8(x2, group=self.block[1])
            else:
                q, s = quantize_fp8(x2, scale=layer.input_scale if self.static_input else None)
            y = w8a8_product(q, s, layer.weight, layer.weight_scale, x.dtype, self.block)
        else:
            y = x2 @ self.dequantized_weight(layer).to(x.dtype).t()
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def takes_gemv(self, x2: torch.Tensor, mode: str | None = None) -> bool:
        """Whether x2 [M, K] goes to the decode GEMV in `mode` (default $TINYPAGED_FP8_GEMV):
        up to FP8_GEMV_MAX_M[mode] rows (the kernel takes 1-16; kernels/dense_gemv.py says why
        W8A16 takes fewer), unless $TINYPAGED_DENSE_GEMV=0 (then W8A8 through fp8_gemm at every
        size: the A/B switch). A static input_scale is not used by either GEMV mode."""
        mode = mode or fp8_gemv_mode()
        return 1 <= x2.shape[0] <= FP8_GEMV_MAX_M[mode] and gemv_enabled()


def w8a8_product(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                 weight_scale: torch.Tensor, out_dtype: torch.dtype,
                 block: tuple[int, int] | None) -> torch.Tensor:
    """y [M, N] = (q * s) @ (weight * weight_scale)^T for an already-quantized x (q e4m3
    [M, K], s its scales): kernels/fp8_rows.py at 2-16 rows (fp8_rows_enabled), else the GEMM."""
    if fp8_rows_enabled(q.shape[0]):
        return fp8_rows(q, s, weight, weight_scale, out_dtype, block,
                        **fp8_rows_config(q.shape[0], block))
    return fp8_gemm(q, s, weight, weight_scale, out_dtype, block)


def fp8_silu_and_mul_down(down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
    """down(silu_and_mul(gate_up)) for an FP8 row-parallel `down` where the Triton kernels run,
    one launch before the all-reduce and the bias: at decode (takes_gemv) the decode GEMV forms
    silu(gate) * up as it loads its input (kernels/dense_gemv.py); on the W8A8 path with dynamic
    activations SiLU-and-mul and the per-token (group) quantization are one kernel
    (kernels/fp8_act.py), then the FP8 GEMM. None where neither applies (another method, static
    input scales past 16 rows, the CPU path) or LoRA on `down` in a step with an adapter (its
    delta is added in down's own matmul: lora/layers.py): the caller runs the separate ops."""
    method = getattr(down, "quant_config", None)
    if (not isinstance(method, Fp8Config) or not use_triton(gate_up)
            or (down.lora is not None and down.lora.active)):
        return None
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    mode = fp8_gemv_mode()
    if method.takes_gemv(x2, mode):
        y = dense_gemv(x2, down.weight, None, down.weight_scale, method.block, silu_and_mul=True,
                       **fp8_gemv_config(x2.shape[0], method.block, mode,
                                         down.weight.shape[0], silu_and_mul=True))
    elif method.static_input:
        return None
    else:
        q, s = silu_and_mul_quant_fp8(x2, None if method.block is None else method.block[1])
        y = w8a8_product(q, s, down.weight, down.weight_scale, gate_up.dtype, method.block)
    y = all_reduce(y.reshape(*gate_up.shape[:-1], -1))
    return y if down.bias is None else y + down.bias


def fp8_norm_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor,
                    residual: torch.Tensor | None,
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """linear(norm(x)) for an FP8 column-parallel `linear` on the W8A8 path, with the norm's
    output quantized in the norm's own pass (kernels/norm.py's rms_norm_quant_fp8), so that
    apply's separate quantize_fp8 launch goes:

        r = x + residual                    (x itself when residual is None)
        q, s = quantize(rms_norm(r))        per token, or per token and group of block[1] inputs
        y = (q * s) @ (weight * weight_scale)^T + bias

    Returns (y [..., N], r): what `norm(x, residual)` then `linear` return, with the same
    quantized operands as apply, so the same numbers. None where apply would not quantize x
    this way: another method or no Triton (the CPU path is weight-only), the decode GEMV's
    rows (takes_gemv: it reads x unquantized), a static input_scale (the norm kernel computes
    dynamic scales only), LoRA on `linear` in a step with an adapter (its delta reads the
    unquantized x; without one the step runs as LoRA-off: lora/idle.py), hidden sizes
    not a whole number of groups. The caller then runs the norm and the linear as before."""
    method = getattr(linear, "quant_config", None)
    if (not isinstance(method, Fp8Config) or not use_triton(x) or method.static_input
            or (linear.lora is not None and linear.lora.active)):
        return None
    if method.takes_gemv(x.reshape(-1, x.shape[-1])):
        return None
    group = None if method.block is None else method.block[1]
    if group is not None and x.shape[-1] % group:
        return None
    q, s, *summed = rms_norm_quant_fp8(x, norm.weight, norm.eps, residual, group)
    y = w8a8_product(q, s, linear.weight, linear.weight_scale, x.dtype, method.block)
    y = y.reshape(*x.shape[:-1], -1)
    return (y if linear.bias is None else y + linear.bias), (summed[0] if summed else x)


@dataclass(frozen=True)
class CompressedTensorsFp8Config(Fp8Config):
    """compressed-tensors checkpoints (llm-compressor) whose linears are FP8: format
    "float-quantized", one config group of 8-bit float weights (strategy "channel" or
    "tensor") and 8-bit float input activations (strategy "token", dynamic, or "tensor")."""

    name: ClassVar[str] = "compressed-tensors"

    @classmethod
    def from_config(cls, quantization_config: dict) -> CompressedTensorsFp8Config:
        q = cls.own_config(quantization_config)
        fmt = q.get("format", "float-quantized")
        if fmt != "float-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r}: tinypaged runs "
                             "'float-quantized' (FP8) checkpoints")
        groups = list((q.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups: "
                             "tinypaged runs one group covering every Linear")
        group = groups[0]
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights {weights}: tinypaged runs 8-bit float "
                             "(FP8) weights")
        strategy = weights.get("strategy")
        block = weights.get("block_structure")
        if strategy == "block" and block is not None and tuple(block) in SUPPORTED_BLOCKS:
            weight_scheme, block = "block", tuple(block)
        elif strategy in ("channel", "tensor"):
            weight_scheme, block = strategy, None
        else:
            raise ValueError(f"compressed-tensors weight strategy {strategy!r}: tinypaged runs "
                             "'channel', 'tensor' and 'block' [128, 128]")
        static = False
        if inputs is not None:
            if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors input_activations {inputs}: tinypaged "
                                 "runs 8-bit float activations")
            static = not inputs.get("dynamic", True)
            if static and inputs.get("strategy") != "tensor":
                raise ValueError("compressed-tensors static input activations must be per tensor")
            if weight_scheme == "block" and (static or inputs.get("strategy") != "group"):
                raise ValueError("compressed-tensors block-wise weights need dynamic "
                                 "per-group input activations")
        _check_ignored(q.get("ignore"), "ignore")
        # kv_cache_scheme: the checkpoint's k_scale / v_scale serve kv_cache_dtype="fp8"
        # (models/kv_scales.py)
        return cls(weight_scheme=weight_scheme, static_input=static, block=block)

    def create_weights(self, layer, input_size, output_size_per_partition, params_dtype):
        super().create_weights(layer, input_size, output_size_per_partition, params_dtype)
        if self.weight_scheme == "block":  # compressed-tensors names it weight_scale
            layer.register_parameter("weight_scale", layer.weight_scale_inv)
            del layer.weight_scale_inv

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return


def _check_blocks(layer: nn.Module, K: int, bn: int, bk: int) -> None:
    """Each rank's slice, and each shard of a fused layer, must be whole scale blocks."""
    sizes = [layer.shard_layout(s)[1] for s in layer.shard_ids()] \
        if hasattr(layer, "shard_layout") else []
    tp = getattr(layer, "tp_size", 1)
    if any(s % bn for s in sizes) or (tp > 1 and (K % bk or layer.output_size % bn)):
        raise ValueError(f"block-wise FP8: a linear's shards {sizes or [layer.output_size]} "
                         f"x {K} inputs (per tensor-parallel rank) are not whole blocks of "
                         f"[{bn}, {bk}]; use a smaller tensor_parallel_size")


def _per_tensor_scale_loader(layer: nn.Module):
    """A per-tensor weight_scale (shape [] or [1]) fills its shard's rows of the [N, 1] scale."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"expected one per-tensor weight_scale, got shape "
                             f"{tuple(loaded.shape)}")
        if shard_id is None:
            param.data.fill_(loaded.reshape(()).float().item())
        else:
            offset, size, _, _ = layer.shard_layout(shard_id)
            param.data[offset : offset + size] = loaded.reshape(()).float().to(param.device)

    return load


def _max_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A static input_scale: a fused layer quantizes its one input with its shards' largest."""
    if loaded.numel() != 1:
        raise ValueError(f"expected one per-tensor input_scale, got shape {tuple(loaded.shape)}")
    param.data.copy_(torch.maximum(param.data, loaded.reshape(()).float().to(param.device)))
