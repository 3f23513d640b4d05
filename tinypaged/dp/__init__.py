"""Data parallelism in one node: N engine processes behind one router (router.py), for the
server (client.py: DPAsyncLLM) and for LLM (offline.py: DataParallelEngine); launch.py starts
the engines, each on its slice of the GPUs or all sharing one."""
