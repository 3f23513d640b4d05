"""TensorSlice: a checkpoint tensor read from disk only as far as the weight loader uses it.

With tensor parallelism each rank keeps 1/N of most tensors. The weight loaders (layers.py) cut
their part with `narrow`, `split` or `[a:b]`, check `.shape`, then `copy_` it into the parameter.
Given a TensorSlice instead of a tensor, the cuts only shrink a box of index ranges, and the
copy reads just that box from the safetensors file (`safe_open(...).get_slice(name)[box]`):

    t = TensorSlice(handle.get_slice("...o_proj.weight"))   # [out, in] on disk; nothing read
    part = t.narrow(1, r * (in // N), in // N)               # rank r's columns; nothing read
    param.copy_(part)                                        # reads out x in/N elements

Any other use (arithmetic, torch.cat, .view, a quant method's own loader, ...) first reads the
whole box into a real tensor: code that knows nothing about slices stays correct, only unsharded.
`bytes_read` counts what this tensor and every slice cut from it have read so far.
"""

from __future__ import annotations

from typing import Any

import torch


class TensorSlice:
    def __init__(self, source: Any, box: tuple[tuple[int, int], ...] | None = None,
                 counter: list[int] | None = None) -> None:
        self._source = source  # a safetensors PySafeSlice (get_shape(), [slices] reads)
        self._box = box if box is not None else tuple((0, n) for n in source.get_shape())
        self._counter = counter if counter is not None else [0]  # shared with derived slices

    # ---------------------------------------------------------------- what a loader asks
    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._box)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._box)

    ndim = property(dim)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def bytes_read(self) -> int:
        return self._counter[0]

    def narrow(self, dim: int, start: int, length: int) -> TensorSlice:
        dim = dim % self.dim()
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise RuntimeError(
                f"narrow: start ({start}) + length ({length}) exceeds dimension size ({size})"
            )
        box = list(self._box)
        first = box[dim][0] + start
        box[dim] = (first, first + length)
        return TensorSlice(self._source, tuple(box), self._counter)

    def split(self, split_size: int | list[int], dim: int = 0) -> tuple[TensorSlice, ...]:
        size = self.shape[dim]
        if isinstance(split_size, int):
            sizes = [min(split_size, size - s) for s in range(0, size, split_size)]
        else:
            sizes = list(split_size)
            if sum(sizes) != size:
                raise RuntimeError(f"split sizes {sizes} do not add up to dimension size {size}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, n) for s, n in zip(starts, sizes))

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1) and self.dim() > 0:
            start, stop, _ = key.indices(self.shape[0])
            return self.narrow(0, start, max(0, stop - start))
        return self.materialize()[key]

    # ---------------------------------------------------------------- reading
    def materialize(self) -> torch.Tensor:
        """Read the box from the file: a real CPU tensor of `self.shape`."""
        index = tuple(slice(start, stop) for start, stop in self._box) if self._box else ()
        tensor = self._source[index]
        self._counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch calls this when a TensorSlice is an argument (param.copy_(s), torch.cat([s]),
        # ...): read the slices, then run the function on real tensors.
        def real(a):
            if isinstance(a, TensorSlice):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str):
        if name.startswith("_"):  # no reads for private names (copy, pickle, half-built objects)
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"TensorSlice(shape={tuple(self.shape)}, box={self._box})"
