"""Side inputs split per micro-batch: tensors by rows, ``Whole`` values and constants as is."""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime import side_inputs
from pipetrain.runtime.side_inputs import Whole


def test_tensors_split_like_the_inputs_and_whole_values_reach_every_microbatch():
    mask = torch.arange(10).reshape(5, 2)
    table = torch.ones(5, 3)  # as many rows as the batch, but not batched
    per_mb = side_inputs.split(
        {"mask": mask, "rope": Whole(table), "scale": 0.5, "none": None}, 5, 2, "cpu"
    )
    assert [mb["mask"].tolist() for mb in per_mb] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    assert all(mb["rope"] is table and mb["scale"] == 0.5 and mb["none"] is None for mb in per_mb)


def test_a_tensor_without_the_batch_rows_is_refused():
    with pytest.raises(ValueError, match=r"'rope' has 7 rows .* batch has 5.*Whole"):
        side_inputs.split({"rope": torch.ones(7, 3)}, 5, 2, "cpu")
    with pytest.raises(ValueError, match="'scale' has no rows"):
        side_inputs.split({"scale": torch.tensor(2.0)}, 5, 2, "cpu")


def test_names_no_stage_takes_and_tensors_needing_gradients_are_refused():
    takes = [frozenset({"attention_mask"}), frozenset()]
    side_inputs.check({"attention_mask": torch.ones(2)}, takes)
    with pytest.raises(ValueError, match="'attn' is taken by no stage"):
        side_inputs.check({"attn": torch.ones(2)}, takes)
    side_inputs.check({"anything": 1}, [None])  # a stage with **kwargs takes any name
    with pytest.raises(ValueError, match="'rope' requires a gradient"):
        side_inputs.check({"rope": Whole(torch.ones(2, requires_grad=True))}, [None])
