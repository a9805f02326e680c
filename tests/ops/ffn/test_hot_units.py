"""Choosing a layer's hot units from its fire counts (ops/ffn/hot_units.py)."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.ops.ffn.hot_units import choose_hot_units


def test_hot_units_fire_on_at_least_the_share_then_fill_to_the_multiple():
    fires = torch.tensor([0, 10, 0, 3, 1])  # of 10 tokens
    assert choose_hot_units(fires, 10, 0.3, multiple=1).tolist() == [1, 3]
    assert choose_hot_units(fires, 10, 0.31, multiple=1).tolist() == [1]
    assert choose_hot_units(fires, 10, 0.31, multiple=3).tolist() == [1, 3, 4]  # the next most firing
    assert choose_hot_units(fires, 10, 0.05, multiple=8).tolist() == [0, 1, 2, 3, 4]  # never past H
    # At most the max_units most firing, rounded down to the multiple.
    assert choose_hot_units(fires, 10, 0.05, multiple=1, max_units=2).tolist() == [1, 3]
    assert choose_hot_units(fires, 10, 0.05, multiple=2, max_units=3).tolist() == [1, 3]
    empty = choose_hot_units(fires, 11, 1.0)
    assert empty.dtype == torch.int64 and empty.numel() == 0  # no unit fires on all 11 tokens


def test_a_share_outside_zero_to_one_is_a_clear_error():
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            choose_hot_units(torch.tensor([1, 2]), 10, share)
