"""hf_kvcache.rope: the hand-written shape broadcast of `KeyRotation._turn_at` agrees with torch's."""

import pytest
import torch

from hf_kvcache.rope import _broadcast_shape


@pytest.mark.parametrize("a,b", [((2, 3, 4), (3, 4)), ((1, 3, 1, 64), (2, 1, 5, 64)), ((5,), (1,)),
                                 ((2, 0, 3), (1, 3)), ((1,), (0,)), ((), (2, 2))])
def test_broadcast_shape_matches_torch(a, b):
    assert _broadcast_shape(a, b) == tuple(torch.broadcast_shapes(a, b))


def test_broadcast_shape_rejects_mismatch():
    with pytest.raises(ValueError, match="do not broadcast"):
        _broadcast_shape((2, 3), (4, 3))
