"""Tensor-parallel arithmetic against numpy's own split."""

import numpy as np
import pytest

from shardcast import tp


@pytest.mark.parametrize("size", [0, 1, 7, 8, 33, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rank_ranges_match_array_split(size, world):
    parts = np.array_split(np.arange(size), world)
    for r in range(world):
        a, b = tp.rank_range(size, r, world)
        assert list(range(a, b)) == parts[r].tolist()


@pytest.mark.parametrize("shape,dim", [((6, 4), 0), ((6, 4), 1), ((3, 5, 7), 1), ((3, 5, 7), 2), ((9,), 0),
                                       ((6, 4), None), ((6, 4), -1)])
def test_byte_ranges_cover_exactly_the_ranks_part(shape, dim):
    x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    raw = x.tobytes()
    for world in (2, 3):
        for r in range(world):
            want = x[tp.rank_index(shape, dim, r, world)]
            got = b"".join(raw[o:o + n] for o, n in tp.byte_ranges(shape, 4, dim, r, world))
            assert got == np.ascontiguousarray(want).tobytes()


def test_dims_by_name_and_glob():
    dims = {"*.q_proj.weight": 0, "model.layers.0.self_attn.q_proj.weight": 1, "lm_head.weight": 0}
    assert tp.dim_for("model.layers.0.self_attn.q_proj.weight", dims) == 1  # exact wins
    assert tp.dim_for("model.layers.5.self_attn.q_proj.weight", dims) == 0
    assert tp.dim_for("lm_head.weight", dims) == 0
    assert tp.dim_for("model.norm.weight", dims) is None
    with pytest.raises(ValueError):
        tp.rank_range(4, 2, 2)
