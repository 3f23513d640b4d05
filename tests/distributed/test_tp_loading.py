"""Sharded loading: a tensor-parallel rank reads only its slice of each checkpoint tensor.

Each rank's model is built in this process as rank r of 2 (`distributed.build_as`) and loaded
from safetensors through TensorSlices (`iterate_weights(dir, sliced=True)`, what `load_model`
does under tensor parallelism), counting the bytes read per checkpoint tensor and rank. Sharded
tensors (q/k/v, o, gate/up, down, embedding, LM head): the two ranks' reads add up to the
tensor exactly once. Replicated ones (norms; k and v when one KV head serves two ranks): read
whole by each rank. The parameters equal those loaded from whole tensors.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import single_thread, tiny_hf_model  # noqa: F401 - autouse fixture
from safetensors import safe_open
from safetensors.torch import save_file

from tinypaged.distributed import parallel_state as distributed
from tinypaged.models.loader import iterate_weights, load_hf_config
from tinypaged.models.registry import get_model_class
from tinypaged.models.tensor_slice import TensorSlice


def counting(pairs, counts: dict[str, int]):
    for name, tensor in pairs:
        yield name, tensor
        counts[name] = tensor.bytes_read  # the loader is done with it once we are resumed


@pytest.mark.parametrize("kind, overrides", [
    ("llama_untied", {}),
    ("qwen3", {"num_key_value_heads": 1, "vocab_size": 251}),  # replicated KV, padded vocab
    ("phi3", {}),  # fused qkv_proj / gate_up_proj: each rank reads its rows of each part
])
def test_each_rank_reads_only_its_slice(tmp_path, kind, overrides):
    tiny_hf_model(kind, seed=4, **overrides).save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    full = {name: t.numel() * t.element_size() for name, t in iterate_weights(tmp_path)}
    replicated = {n for n in full if "norm" in n}
    if config.num_key_value_heads == 1:
        replicated |= {n for n in full if n.endswith(("k_proj.weight", "v_proj.weight"))}

    reads = []
    for rank in range(2):
        with distributed.build_as(rank, 2):
            sliced, whole = get_model_class(config)(config), get_model_class(config)(config)
        counts: dict[str, int] = {}
        sliced.load_weights(counting(iterate_weights(tmp_path, sliced=True), counts))
        whole.load_weights(iterate_weights(tmp_path))
        for (name, a), (_, b) in zip(sliced.named_parameters(), whole.named_parameters()):
            assert torch.equal(a, b), f"rank {rank}: {name} differs from whole-tensor loading"
        assert counts.keys() == full.keys()
        reads.append(counts)

    for name, nbytes in full.items():
        if name in replicated:
            assert reads[0][name] == reads[1][name] == nbytes, name
        else:
            assert reads[0][name] + reads[1][name] == nbytes, name
            assert 0 < reads[0][name] <= nbytes // 2 + 1024, name  # half, +1 row of padding
    assert sum(reads[0].values()) < 0.7 * sum(full.values())


def test_tensor_slice_cuts_without_reading(tmp_path):
    t = torch.arange(60.0).view(6, 10)
    save_file({"t": t}, tmp_path / "a.safetensors")
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as handle:
        s = TensorSlice(handle.get_slice("t"))
        assert s.shape == (6, 10) and s.dim() == 2 and s.numel() == 60
        part = s.narrow(1, 2, 4)[1:5]  # rows 1..4, columns 2..5
        top, rest = part.split([1, 3], dim=0)
        assert rest.shape == (3, 4) and s.bytes_read == 0
        out = torch.empty(3, 4)
        out.copy_(rest)  # reads only the box
        assert torch.equal(out, t[2:5, 2:6]) and s.bytes_read == 12 * 4
        # Anything else reads the box first and stays correct.
        assert torch.equal(torch.cat([top, rest]), t[1:5, 2:6])
        assert torch.equal(s.t(), t.t())
        assert s.bytes_read == (12 + 16 + 60) * 4
        assert [p.shape[0] for p in s.split(4)] == [4, 2]
        with pytest.raises(RuntimeError, match="exceeds dimension size"):
            s.narrow(0, 4, 3)
        with pytest.raises(RuntimeError, match="do not add up"):
            s.split([2, 2])
