"""Tensor-parallel slices: which part of a tensor a rank uses.

A split along ``dim`` over ``world_size`` ranks gives rank ``r`` the indices
``[start, stop)`` of that dimension, in the way ``numpy.array_split`` / ``torch.tensor_split``
divide: when the size does not divide evenly, the first ``size % world_size`` ranks get one
more. Column-parallel layers (``q/k/v``, ``gate``/``up`` projections, embeddings) split
dim 0 of their weight; row-parallel ones (``o_proj``, ``down_proj``) split dim 1.
"""

import fnmatch


def rank_range(size, rank, world_size):
    """``(start, stop)`` of ``rank``'s part of a dimension of ``size``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tp_rank {rank} is not in 0..{world_size}")
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def dim_for(name, shard_dims):
    """The dimension ``name`` is split along, or ``None`` (replicated). ``shard_dims`` maps a
    tensor name, or a glob over names (``"*.q_proj.weight"``), to a dimension; an exact name
    wins over a glob, and among globs the first that matches."""
    if not shard_dims:
        return None
    if name in shard_dims:
        return shard_dims[name]
    for pattern, dim in shard_dims.items():
        if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
            return dim
    return None


def rank_index(shape, dim, rank, world_size):
    """The basic index (a tuple of slices) selecting ``rank``'s part of a tensor of
    ``shape`` split along ``dim``."""
    if dim is None:
        return tuple(slice(None) for _ in shape)
    if dim < 0:
        dim += len(shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"cannot split a tensor of shape {tuple(shape)} along dim {dim}")
    start, stop = rank_range(shape[dim], rank, world_size)
    return tuple(slice(start, stop) if i == dim else slice(None) for i in range(len(shape)))


def byte_ranges(shape, itemsize, dim, rank, world_size):
    """The byte ranges ``[(offset, length)]``, relative to a row-major tensor's start, that
    ``rank``'s part covers: one range for a split along dim 0 (or a replicated tensor), one
    per outer row for a split along a later dimension."""
    if dim is None:
        n = itemsize
        for s in shape:
            n *= s
        return [(0, n)] if n else []
    if dim < 0:
        dim += len(shape)
    start, stop = rank_range(shape[dim], rank, world_size)
    inner = itemsize
    for s in shape[dim + 1:]:
        inner *= s
    outer = 1
    for s in shape[:dim]:
        outer *= s
    row = shape[dim] * inner
    length = (stop - start) * inner
    if length == 0:
        return []
    return [(o * row + start * inner, length) for o in range(outer)]
