"""Compile kernels for the H200 (sm_90) on a CPU, for the compile tests of each kernel family.

The interpreter accepts programs the GPU compiler rejects (layouts, dot shapes, shared memory),
so a child process builds the kernels as GPU kernels, swaps in a driver that only names the
target, and turns each launch into a compile (`warmup`): Triton's own ptxas must accept the
code and its shared memory must fit the H200's 227 KiB. Uses Triton 3.6 internals (driver
config, JITFunction.run), the version the CPU constraints pin.
"""

import subprocess
import sys
from pathlib import Path

PRELUDE = r"""
import torch
torch.cuda.device_count = lambda: 1  # tinypaged.kernels then builds GPU kernels
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


class CompileOnlyDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(CompileOnlyDriver())
compiled = set()
launch = JITFunction.run


def compile_only(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.metadata.shared <= 227 * 1024, (self.__name__, kernel.metadata.shared)
    compiled.add(self.__name__)


JITFunction.run = compile_only
"""


def compile_for_sm90(launches: str) -> list[str]:
    """Run `launches` (Python calling the launchers) in a child with every launch compiled for
    sm_90 instead of run; returns the sorted names of the kernels that compiled."""
    child = PRELUDE + launches + '\nprint(" ".join(sorted(compiled)))\n'
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", child], cwd=repo, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()
