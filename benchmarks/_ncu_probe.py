import sys
sys.path.insert(0, "benchmarks")
import torch
from awq_gemv import GROUP, awq_weights
from tinypaged.kernels import awq
K, N = 4096, 14336
(qw, qz, s), = awq_weights(K, N, 1)
x = torch.randn(1, K, device="cuda").bfloat16()
for _ in range(3):
    y = awq._awq_gemv1(x, qw, qz, s, GROUP)
torch.cuda.synchronize()
