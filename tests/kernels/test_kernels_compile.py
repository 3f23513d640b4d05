"""Every kernel (AWQ too), through its real launcher, compiles for the H200 (sm_90) on a CPU
(see helpers/compile_sm90.py for how); the FP8 GEMV's w8a8dot tiles and fp8_rows' to FP8 wgmma."""

from helpers.compile_sm90 import compile_for_sm90

LAUNCHES = r"""
from tinypaged.kernels import (activation, attention, kv_cache, norm, rejection, rotary,
                               rotary_kv_cache, spec_shift)

for dtype in (torch.bfloat16, torch.float16):
    x = torch.randn(4, 4096).to(dtype)
    norm.rms_norm_triton(x, torch.randn(4096).to(dtype), 1e-6, x.clone())
    activation.silu_and_mul_triton(torch.randn(4, 2 * 14336).to(dtype))
    activation.gelu_tanh_and_mul_triton(torch.randn(4, 2 * 14336).to(dtype))
    q, k = torch.randn(4, 32, 128).to(dtype), torch.randn(4, 8, 128).to(dtype)
    for rotary_dim, interleaved in ((128, False), (64, True)):
        cache = rotary.build_cos_sin_cache(rotary_dim, 8, 10000.0)
        rotary.rotary_embedding_triton(torch.arange(4), q, k, cache, rotary_dim, interleaved)
    for num_q_heads, num_kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
        q = torch.randn(4, num_q_heads, head_dim).to(dtype)
        k_cache = torch.randn(8, 16, num_kv_heads, head_dim).to(dtype)
        kv_cache.store_kv_triton(q[:, :num_kv_heads], q[:, :num_kv_heads], k_cache,
                                 k_cache.clone(), torch.arange(4))
        cache = rotary.build_cos_sin_cache(head_dim // 2, 8, 10000.0)
        norm_w = torch.ones(head_dim).to(dtype)
        for interleaved, weights in ((False, (norm_w, norm_w)), (True, (None, None))):
            rotary_kv_cache.rotary_store_kv_triton(
                torch.arange(4), q, q[:, :num_kv_heads], q[:, :num_kv_heads], k_cache,
                k_cache.clone(), torch.arange(4), cache, head_dim // 2, interleaved, *weights)
        args = (q, k_cache, k_cache.clone(), torch.zeros(2, 4, dtype=torch.int32),
                torch.tensor([40, 9], dtype=torch.int32))
        for window, softcap in ((None, None), (8, 50.0)):  # Gemma 2's local layers
            for max_query_len in (3, 40, 2048):  # the three default query tiles
                attention.paged_attention_triton(
                    *args, torch.tensor([0, 3, 4], dtype=torch.int32), 0.1,
                    max_query_len=max_query_len, max_seq_len=40, sliding_window=window,
                    softcap=softcap)
            for num_splits in (1, 4):
                attention.paged_attention_triton(
                    *args, torch.tensor([0, 1, 2], dtype=torch.int32), 0.1, max_query_len=1,
                    max_seq_len=40, num_splits=num_splits, sliding_window=window,
                    softcap=softcap)
                for max_query_len in (2, 5):  # a verification's k + 1 tokens in one program
                    attention.paged_attention_triton(
                        *args, torch.tensor([0, 2, 4], dtype=torch.int32), 0.1,
                        max_query_len=max_query_len, max_seq_len=40, num_splits=num_splits,
                        sliding_window=window, softcap=softcap, uniform_decode=True)
        # the sm_90 prefill kernel at its config: pointer loads from 16-token blocks, TMA from
        # 64-token blocks (CPU tensors never dispatch to it, so call its launcher)
        for block_size in (16, 64):
            k_cache = torch.randn(8, block_size, num_kv_heads, head_dim).to(dtype)
            attention.hopper_attention_triton(
                q, k_cache, k_cache.clone(), *args[3:], torch.tensor([0, 3, 4], dtype=torch.int32),
                0.1, torch.empty_like(q), **attention.HOPPER_CONFIG)
from tinypaged.kernels import moe, moe_align, moe_gemv, moe_routing

for block_m in (16, 64, 128):  # the grouped GEMM's row blocks, Qwen3-30B-A3B's 128 experts
    moe_align.moe_align_block_size_triton(torch.randint(0, 128, (64, 8)), block_m, 128)
    moe_align.moe_align_block_size_parallel(torch.randint(0, 128, (256, 8)), block_m, 128)

every_config = (1, 64, 256, 512, 4096)  # every tile config of get_config
for dtype, token_counts in ((torch.bfloat16, every_config), (torch.float16, (8,)),
                            (torch.float32, every_config)):  # fp32: twice the bytes per tile
    w13, w2 = torch.zeros(4, 2 * 768, 2048).to(dtype), torch.zeros(4, 2048, 768).to(dtype)
    for num_tokens in token_counts:  # the Qwen3-30B-A3B dims
        topk_ids = torch.randint(0, 4, (num_tokens, 2), dtype=torch.int32)
        moe.fused_experts_triton(torch.randn(num_tokens, 2048).to(dtype), w13, w2,
                                 torch.rand(num_tokens, 2), topk_ids)
        for scoring_func, bias in (("softmax", None), ("sigmoid", torch.zeros(128))):
            moe_routing.select_experts_triton(torch.randn(num_tokens, 128).to(dtype), 8,
                                              renormalize=True, scoring_func=scoring_func,
                                              e_score_correction_bias=bias)
        if num_tokens <= 8:  # the decode GEMVs
            moe_gemv.fused_experts_gemv(torch.randn(num_tokens, 2048).to(dtype), w13, w2,
                                        torch.rand(num_tokens, 2), topk_ids)
        if num_tokens == 1 and dtype != torch.float32:  # with FP8 experts (W8A16)
            f13, f2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
            for s13, s2, block in ((torch.ones(4, 2 * 768, 1), torch.ones(4, 2048, 1), None),
                                   (torch.ones(4, 12, 16), torch.ones(4, 16, 6), (128, 128))):
                moe_gemv.fused_experts_gemv(torch.randn(1, 2048).to(dtype), f13, f2,
                                            torch.rand(1, 2), topk_ids, w13_scale=s13,
                                            w2_scale=s2, block=block)
from tinypaged.kernels.all_reduce import custom_all_reduce

for world_size in (2, 3, 8):  # the custom all-reduce's two kernels, the engine's launch
    ptrs, counters = torch.zeros(world_size + 1, dtype=torch.int64), torch.zeros(64).int()
    for dtype, two_shot in ((torch.bfloat16, False), (torch.float16, True)):
        x = torch.zeros(4096).to(dtype)
        custom_all_reduce(x, x, ptrs, counters, 1, 128, 2**20, two_shot=two_shot)
import os

from tinypaged.kernels import awq, awq_mma, dense_gemv, gptq_int8

os.environ["TRITON_INTERPRET"] = "1"  # only so awq_dequantize's dispatch picks the kernel
for dtype in (torch.bfloat16, torch.float16):
    for K, N, group in ((4096, 1024, 128), (512, 256, 32)):
        qweight = torch.zeros(K, N // 8, dtype=torch.int32)
        qzeros = torch.zeros(K // group, N // 8, dtype=torch.int32)
        scales = torch.ones(K // group, N).to(dtype)
        for scales_t in (None, awq.gemv_scales(scales)):
            awq._awq_gemv1(torch.randn(1, K).to(dtype), qweight, qzeros, scales, group,
                           scales_t=scales_t)
        awq._awq_gemv(torch.randn(8, K).to(dtype), qweight, qzeros, scales, group, split_k=2)
        for m in (64, 200):
            awq._awq_gemm(torch.randn(m, K).to(dtype), qweight, qzeros, scales, group)
        for m in (2, 16):  # the decode paths as on the GPU (paired-PTX dequant)
            awq._awq_gemv(torch.randn(m, K).to(dtype), qweight, qzeros, scales, group,
                          scales_t=awq.gemv_scales(scales), asm=True)
            awq_mma.awq_mma(torch.randn(m, K).to(dtype), qweight, qzeros, scales, group,
                            scales_t=awq.gemv_scales(scales), asm=True,
                            **awq.DECODE_PATHS[0][3])
        awq.awq_dequantize(qweight, qzeros, scales, group)
for dtype in (torch.bfloat16, torch.float16):  # dense and int8 split-K (the finish adds a bias)
    weight, bias = torch.zeros(1024, 4096).to(dtype), torch.zeros(1024).to(dtype)
    for m, config in ((1, dict(programs_per_sm=2)), (8, dense_gemv._TENSOR_CORES)):
        dense_gemv.dense_gemv(torch.randn(m, 4096).to(dtype), weight, bias, split_k=4, **config)
    w8 = weight.to(torch.float8_e4m3fn)  # FP8 weights (W8A16): e4m3 converted in registers
    for m, mode in ((1, "w8a16"), (8, "w8a16"), (1, "w8a8dot"), (16, "w8a8dot")):
        for scale, block in ((torch.ones(1024, 1), None), (torch.ones(8, 32), (128, 128))):
            config = dense_gemv.fp8_gemv_config(m, block, mode)  # w8a8dot: e4m3 x, FP8 wgmma
            dense_gemv.dense_gemv(torch.randn(m, 4096).to(dtype), w8, bias, scale, block,
                                  split_k=4, **config)
            dense_gemv.dense_gemv(torch.randn(m, 8192).to(dtype), w8, None, scale, block,
                                  silu_and_mul=True,
                                  **dense_gemv.fp8_gemv_config(m, block, mode, silu_and_mul=True))
            if m == 1 and mode == "w8a16":  # the wide weights' tile; e4m3 bytes to fp32 by
                # integer ops (w8_words)
                dense_gemv.dense_gemv(torch.randn(m, 4096).to(dtype), w8, None, scale, block,
                                      **dense_gemv.fp8_gemv_config(m, block, mode,
                                                                   dense_gemv.WIDE_N))
                dense_gemv.dense_gemv(torch.randn(m, 8192).to(dtype), w8, None, scale, block,
                                      silu_and_mul=True, w8_words=True, **config)
    for group in (None, 128):  # RMSNorm with its output quantized to e4m3 (W8A8 prefill)
        x = torch.randn(4, 4096).to(dtype)
        norm.rms_norm_quant_fp8_triton(x, torch.randn(4096).to(dtype), 1e-6, x.clone(), group)
    q8, z8 = torch.zeros(4096, 1024, dtype=torch.uint8), torch.zeros(32, 1024, dtype=torch.uint8)
    for m in (1, 8, 200):  # GEMV, split-K GEMM, dequantize + matmul
        gptq_int8.gptq_int8_gemm(torch.randn(m, 4096).to(dtype), q8, z8,
                                 torch.ones(32, 1024).to(dtype))
# speculative verification: greedy, then sampled with the drafts' probabilities
draft, starts = torch.zeros(3, 4, dtype=torch.int64), torch.tensor([0, 5, 10])
probs = torch.rand(15, 1000)
for target, drafted in ((None, None), (probs, probs)):
    rejection.rejection_sample_triton(draft, torch.tensor([4, 2, 0]), starts, torch.zeros(3),
                                      target, drafted, torch.rand(15),
                                      torch.zeros(15, dtype=torch.int64))
# overlapped verification: a step's rows moved to where the verification in flight ended
spec_shift.shift_to_verified_triton(
    torch.zeros(3, 5, dtype=torch.int64), torch.tensor([2, -1, 0]), torch.tensor([5, 0, 5]),
    torch.tensor([0, 5, 6, 11], dtype=torch.int32), torch.zeros(3, 8, dtype=torch.int32), 16,
    torch.zeros(11, dtype=torch.int64), torch.zeros(11, dtype=torch.int64),
    torch.zeros(11, dtype=torch.int64), torch.zeros(3, dtype=torch.int32))
"""


def test_every_launcher_compiles_for_sm90():
    assert compile_for_sm90(LAUNCHES) == sorted([
        "_decode_merge_kernel", "_decode_split_kernel", "_rms_norm_kernel", "_rotary_kernel",
        "_act_and_mul_kernel", "_store_kv_kernel", "_rotary_store_kv_kernel",
        "_varlen_attention_kernel", "_hopper_attention_kernel",
        "_fused_moe_kernel", "_moe_gemv_gate_up_kernel", "_moe_gemv_down_kernel",
        "_topk_routing_kernel", "_moe_align_kernel", "_moe_align_count_kernel",
        "_moe_align_place_kernel",
        "_awq_gemv1_kernel", "_awq_gemv_kernel", "_awq_gemm_kernel", "_awq_mma_kernel",
        "_awq_dequantize_kernel", "_one_shot_all_reduce_kernel", "_two_shot_all_reduce_kernel",
        "_dense_gemv_kernel", "_int8_gemv1_kernel", "_int8_gemm_kernel", "_int8_dequantize_kernel",
        "_rejection_kernel", "_shift_kernel",
    ])


SHIFT_ALIGNMENTS = r"""
from tinypaged.kernels import spec_shift

ids64, ids32 = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int32)
for at in range(4):  # views at every offset, as a CUDA-graph bucket's inputs are
    spec_shift.shift_to_verified_triton(
        torch.zeros(3, 5, dtype=torch.int64), ids64[at : at + 3], ids64[at + 3 : at + 6],
        ids32[at : at + 4], ids32[at + 8 : at + 32].view(3, 8), 16, ids64[at + 8 : at + 19],
        ids64[at + 20 : at + 31], ids64[at + 32 : at + 43], ids32[at + 40 : at + 43])
print(sum(len(cache[0]) for cache in spec_shift._shift_kernel.device_caches.values()))
"""


def test_the_shift_kernel_compiles_once_for_every_alignment():
    """Outside the CUDA graphs, so a variant per alignment would compile mid-serving."""
    assert compile_for_sm90(SHIFT_ALIGNMENTS) == ["1", "_shift_kernel"]


FP8_DOT_LAUNCHES = r"""
from tinypaged.kernels import dense_gemv

ptx, kernels = [], []


def keep_ptx(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.metadata.shared <= 227 * 1024, (self.__name__, kernel.metadata.shared)
    ptx.append(kernel.asm["ptx"])
    kernels.append(kernel)
    compiled.add(self.__name__)


JITFunction.run = keep_ptx
w8 = torch.zeros(1024, 4096).to(torch.float8_e4m3fn)
for m in (1, 2, 4, 8, 16):
    for scale, block in ((torch.ones(1024, 1), None), (torch.ones(8, 32), (128, 128))):
        for silu in (False, True):
            dense_gemv.dense_gemv(torch.randn(m, 8192 if silu else 4096).to(torch.bfloat16), w8,
                                  None, scale, block, silu_and_mul=silu,
                                  **dense_gemv.fp8_gemv_config(m, block, "w8a8dot"))
import os

from tinypaged.kernels import fp8_rows  # W8A8 at decode: x already e4m3, every table tile

os.environ["TRITON_INTERPRET"] = "1"  # only so fp8_rows' dispatch picks the kernel
a8 = torch.zeros(16, 4096).to(torch.float8_e4m3fn)
for m in (2, 4, 8, 16):
    for scale, a_scale, block in ((torch.ones(1024, 1), torch.ones(m, 1), None),
                                  (torch.ones(8, 32), torch.ones(m, 32), (128, 128))):
        config = fp8_rows.fp8_rows_config(m, block)
        deep = dict(block_n=64, block_k=128 if block else 256, num_warps=4, num_stages=8)
        for tiles in (dict(config, w_tma=False), dict(config, w_tma=True),
                      dict(config, **deep, w_tma=True)):  # W by pointer loads, by TMA
            fp8_rows.fp8_rows(a8[:m], a_scale, w8, scale, torch.bfloat16, block, split_k=4,
                              **tiles)
            assert ("cp.async.bulk.tensor.2d" in ptx[-1]) == tiles["w_tma"], tiles
# e4m3 operands straight into Hopper's FP8 wgmma: no fp16 mma.sync on converted weights
assert ptx and all("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in p
                   and "mma.sync" not in p for p in ptx)
# the TMA variant through tinypaged's Python launcher: the descriptor argument becomes one
# CUtensorMap passed by value (make_tensordesc_arg fills it at each launch)
from tinypaged.kernels.launcher.launch import PackedLaunch


class NoDriver:
    cuLaunchKernelEx = None


kernel = kernels[-1]  # the last TMA variant
packed = PackedLaunch(kernel.src.signature.values(), num_warps=4, shared=kernel.metadata.shared,
                      tensordesc_meta=kernel.metadata.tensordesc_meta, lib=NoDriver())
assert [s.type for s in packed.slots].count("nvTmaDesc") == 1
assert "make_tensordesc_arg(a1, META[0])" in packed.source
# the one-row W8A16 GEMV (CUDA cores) with the weight by TMA too
for scale, block in ((torch.ones(1024, 1), None), (torch.ones(8, 32), (128, 128))):
    for block_k, stages in ((128, 4), (256, 8)):
        dense_gemv.dense_gemv(torch.randn(1, 8192).to(torch.bfloat16), w8, None, scale, block,
                              silu_and_mul=True, **dict(dense_gemv.fp8_gemv_config(1, block),
                                                        block_k=block_k, num_stages=stages,
                                                        w_tma=True))
        assert "cp.async.bulk.tensor.2d" in ptx[-1] and "wgmma" not in ptx[-1]
"""


def test_fp8_dot_tiles_multiply_on_fp8_wgmma():
    assert compile_for_sm90(FP8_DOT_LAUNCHES) == ["_dense_gemv_kernel", "_fp8_rows_kernel"]


FP8_GEMM_LAUNCHES = r"""
import os

from tinypaged.kernels import fp8

os.environ["TRITON_INTERPRET"] = "1"  # only so fp8_gemm's dispatch picks the kernel
ptx = []


def keep_ptx(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.metadata.shared <= 227 * 1024, (self.__name__, kernel.metadata.shared)
    ptx.append(kernel.asm["ptx"])
    compiled.add(self.__name__)


JITFunction.run = keep_ptx
configs = {}  # every tile gemm_config gives from 64 rows on (five), with a shape that takes it
for m in (64, 128, 256, 512, 4096):
    for n in (4096, 6144, 28672):
        configs.setdefault(tuple(sorted(fp8.gemm_config(m, n).items())), (m, n))
assert len(configs) == 5, configs
tma = []
for m, n in configs.values():
    a, w = (torch.zeros(rows, 4096).to(torch.float8_e4m3fn) for rows in (m, n))
    fp8.fp8_gemm(a, torch.ones(m, 1), w, torch.ones(n, 1), torch.bfloat16)
    fp8.fp8_gemm(a, torch.ones(m, 32), w, torch.ones(n // 128, 32), torch.bfloat16, (128, 128))
    tma += [fp8.gemm_config(m, n).get("TMA", False)] * 2
# e4m3 operands straight into Hopper's FP8 wgmma, per channel and block-wise; the tiles that
# ask for TMA load both operands by bulk tensor copies
assert len(ptx) == 10 and all(".e4m3.e4m3" in p and "wgmma.mma_async" in p for p in ptx)
assert [p.count("cp.async.bulk.tensor.2d") >= 2 for p in ptx] == tma and sum(tma) == 8, tma
"""


def test_fp8_gemm_tiles_compile_to_fp8_wgmma():
    assert compile_for_sm90(FP8_GEMM_LAUNCHES) == ["_fp8_gemm_kernel"]


FP8_MOE_LAUNCHES = r"""
from tinypaged.kernels import moe_fp8

# every tile pair of FP8_MOE_CONFIGS, both scale kinds, Qwen3-30B-A3B's dims (4 experts);
# CPU tensors: the quantization and the sort run their references, the two GEMMs compile
w13, w2 = torch.zeros(4, 2 * 768, 2048), torch.zeros(4, 2048, 768)
w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
x, ids = torch.randn(16, 2048).to(torch.bfloat16), torch.randint(0, 4, (16, 8)).int()
done = set()
for scales, block in (((torch.ones(4, 1536, 1), torch.ones(4, 2048, 1)), None),
                      ((torch.ones(4, 12, 16), torch.ones(4, 16, 6)), (128, 128))):
    for t in moe_fp8.FP8_MOE_TOKENS:
        gate_up, down = moe_fp8.fp8_moe_config(t, block)
        key = (block, tuple(gate_up.values()), tuple(down.values()))
        if key not in done:
            done.add(key)
            moe_fp8.fused_experts_fp8_triton(x, w13, w2, *scales, torch.rand(16, 8), ids, block,
                                             config=gate_up, down_config=down)
"""


def test_fp8_moe_table_tiles_compile_for_sm90():
    assert compile_for_sm90(FP8_MOE_LAUNCHES) == ["_fused_moe_fp8_kernel"]


PDL_LAUNCHES = r"""
from tinypaged.kernels import (attention_decode, dense_gemv, fp8, fp8_act, fp8_rows, gguf, norm,
                               rotary_kv_cache)

ptx = {}


def keep_ptx(self, *args, grid, warmup, **kwargs):
    assert kwargs.get("launch_pdl") is True, self.__name__  # launched with the attribute
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    ptx.setdefault(self.__name__, []).append(kernel.asm["ptx"])
    compiled.add(self.__name__)


JITFunction.run = keep_ptx
from tinypaged.kernels import gguf_gemv, gguf_rows, gguf_subdot
from tinypaged.kernels.gguf_format import row_bytes

for module in (attention_decode, dense_gemv, fp8, fp8_act, fp8_rows, norm, rotary_kv_cache,
               gguf_gemv, gguf_rows, gguf_subdot):
    module.pdl_enabled = lambda x: True  # what a CUDA tensor of <= 64 rows on an H200 gets
bf = torch.bfloat16
x = torch.randn(1, 4096).to(bf)
norm.rms_norm_triton(x, torch.ones(4096).to(bf), 1e-6, x.clone())
norm.rms_norm_quant_fp8_triton(x, torch.ones(4096).to(bf), 1e-6, x.clone())
w = torch.zeros(4096, 4096).to(bf)
dense_gemv.dense_gemv(x, w, None, **dict(dense_gemv.gemv_config(1, 4096, 4096), split_k=4))
for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):  # the 2..8-row tiles,
    # and at DOT_MAX_M rows (x^T of 64 columns: a batch-8 verification's 40 rows)
    for m in (5, dense_gemv.DOT_MAX_M):
        dense_gemv.dense_gemv(torch.randn(m, 4096).to(bf), w, None,
                              **dense_gemv.gemv_config(5, N, K))
w8 = w.to(torch.float8_e4m3fn)
dense_gemv.dense_gemv(x, w8, None, torch.ones(4096, 1), None, **dense_gemv.fp8_gemv_config(1, None))
import os

os.environ["TRITON_INTERPRET"] = "1"  # only so these dispatch to their kernels
fp8.quantize_fp8(x)
fp8_act.silu_and_mul_quant_fp8(torch.randn(8, 2 * 4096).to(bf))
fp8_rows.fp8_rows(torch.zeros(8, 4096).to(torch.float8_e4m3fn), torch.ones(8, 1), w8,
                  torch.ones(4096, 1), bf, None,
                  **dict(fp8_rows.fp8_rows_config(8, None), split_k=4))
gguf_rows.interpreting = gguf_subdot.interpreting = lambda: False  # their PTX compiled too
for type_id in (12, 14):  # Q4_K_M's two types, with the tiles decode takes
    qweight = torch.zeros(4096, row_bytes(type_id, 4096), dtype=torch.uint8)
    kernel, config = gguf.decode_path(type_id, 4096, 1)
    gguf_gemv.gguf_gemv(x, qweight, type_id, **config)
    kernel, config = gguf.decode_path(type_id, 4096, 8)
    (gguf_subdot.gguf_subdot if kernel == "subdot" else gguf_rows.gguf_rows)(
        torch.randn(8, 4096).to(bf), qweight, type_id, split_k=4, **config)
del os.environ["TRITON_INTERPRET"]
q = torch.randn(8, 32, 128).to(bf)
k_cache = torch.randn(8, 16, 8, 128).to(bf)
from tinypaged.kernels import rotary

rotary_kv_cache.rotary_store_kv_triton(torch.arange(8), q, q[:, :8], q[:, :8], k_cache,
                                       k_cache.clone(), torch.arange(8),
                                       rotary.build_cos_sin_cache(128, 8, 1e4), 128)
attention_decode.decode_attention_triton(
    q, k_cache, k_cache.clone(), torch.zeros(8, 4, dtype=torch.int32),
    torch.full((8,), 60, dtype=torch.int32), torch.arange(9, dtype=torch.int32), 0.1,
    torch.empty_like(q), num_splits=2, block_n=16, num_warps=4, num_stages=2)
import re

split = 0  # GEMV launches whose split-K sums were checked
LOOPS = ("_dense_gemv_kernel", "_fp8_rows_kernel", "_gguf_gemv_kernel", "_gguf_rows_kernel",
         "_gguf_subdot_kernel")  # the GEMVs: a K loop over the weights
for name, texts in ptx.items():
    for p in texts:
        lines = p.splitlines()
        at = lambda needle: [i for i, line in enumerate(lines) if needle in line]
        wait, trigger = at("griddepcontrol.wait"), at("griddepcontrol.launch_dependents")
        assert len(wait) == 1 and len(trigger) == 1, name
        if name in LOOPS:
            # the weights' L2 prefetch (where the kernel has one) before the wait; every
            # pipelined load of the K loop (cp.async) after it; the trigger after the loop,
            # before the split-K sums go out (red / atom)
            assert all(i < wait[0] for i in at("prefetch.global.L2")), name
            loads = at("cp.async")
            assert not loads or wait[0] < min(loads) and max(loads) < trigger[0], name
            atomics = [i for i, line in enumerate(lines)
                       if re.match(r"\s*(@!?%p\d+\s+)?(atom|red)\.", line)]
            assert not atomics or trigger[0] < min(atomics), name
            split += bool(atomics)
        else:  # elementwise kernels: the next kernel may start at once, then wait first
            assert trigger[0] < wait[0], name
assert split >= 4, split
"""


def test_decode_kernels_chain_by_pdl_on_sm90():
    # Every kernel of the decode step, built as pdl_enabled makes it on an H200: launched with
    # launch_pdl, and in its PTX the wait before any read of another kernel's output
    assert compile_for_sm90(PDL_LAUNCHES) == sorted([
        "_rms_norm_kernel", "_quantize_kernel", "_silu_and_mul_quant_kernel",
        "_dense_gemv_kernel", "_fp8_rows_kernel", "_rotary_store_kv_kernel",
        "_decode_split_kernel", "_decode_merge_kernel",
        "_gguf_gemv_kernel", "_gguf_rows_kernel", "_gguf_subdot_kernel",
    ])
