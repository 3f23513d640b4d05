"""The worker side of a step: executor, tensor-parallel workers, model runner, input batch, CUDA
graphs, GPU memory."""
