"""CUDA graph capture stood in for on the CPU, for tests of the graph wiring."""

from __future__ import annotations

import contextlib

import torch


def fake_cuda_graphs(monkeypatch, graph_cls) -> None:
    """`graph_cls` stands in for torch.cuda.CUDAGraph, and `torch.cuda.graph(g)` sets
    `graph_cls.capturing = g` for the work recorded under it (the test's wrappers record it);
    synchronize does nothing, and the piecewise graphs' weak views are off (the CPU frees a
    tensor as soon as it has no owner)."""
    import tinypaged.worker.piecewise_graphs as pg

    @contextlib.contextmanager
    def capture(graph, pool=None):
        graph_cls.capturing = graph
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_cls)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(pg, "weak_view", lambda t: t)
