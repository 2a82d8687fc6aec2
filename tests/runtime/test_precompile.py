"""``Pipeline(precompile=True)``: every compiled stage's forward and backward compile before the
first step of new shapes, all ranks at once, and leave no trace (``runtime.precompile``)."""

from __future__ import annotations

import pytest

from tests.support.precompile_cases import automatic, precompiled, precompiled_hf, refused
from tests.support.runtime_harness import launch


def test_precompiled_stages_compile_nothing_in_the_step_and_train_exactly():
    assert launch(2, precompiled, ["1f1b", "zbv", "interleaved-1f1b"], timeout=240) == [[], []]


@pytest.mark.parametrize(
    ("how", "want"),
    [
        ("defer", "stage . defers its weight gradients"),
        ("hook", "tensor hook \\(register_hook\\)"),
    ],
)
def test_precompile_is_refused_where_a_stand_in_pass_would_leave_a_trace(how, want):
    import re

    seen = launch(2, refused, how, timeout=120)
    for text in seen:
        assert re.search(f"^ValueError: precompile=True cannot be used here: .*{want}", text), text


def test_precompile_by_default_turns_on_only_where_every_rank_can_and_something_is_compiled():
    assert launch(2, automatic, timeout=120) == [[True, False, False]] * 2


def test_eager_stages_that_defer_only_probe_and_train_exactly():
    assert launch(2, refused, "eager", timeout=120) == ["built: loss equal"] * 2


@pytest.mark.parametrize("variant", ["left", "packed"])
def test_precompiled_hf_layers_take_masks_and_packed_positions(variant):
    pytest.importorskip("transformers")
    assert launch(2, precompiled_hf, variant, timeout=240) == [[], []]


def test_pipetrain_train_compile_precompiles_and_trains_as_eager(tmp_path):
    from tests.support.precompile_cases import app_losses

    corpus = str(tmp_path / "corpus.txt")
    eager = launch(2, app_losses, [], corpus, timeout=120)
    compiled = launch(2, app_losses, ["--compile"], corpus, timeout=240)
    assert [pre for _, pre, _ in eager] == [False, False]
    assert [pre for _, pre, _ in compiled] == [True, True]
    for (want, _, _), (got, _, _) in zip(eager, compiled):
        assert len(got) == 3 and all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(got, want))


def test_pipetrain_train_float8_pipelined_trains_as_on_one_rank(tmp_path):
    """Float8 scales are per tensor per call: the same micro-batches on one rank give the same
    scales, so the losses agree to round-off; every block linear is converted, the head not."""
    pytest.importorskip("torchao")
    from tests.support.precompile_cases import app_losses

    corpus = str(tmp_path / "corpus.txt")
    ((alone, _, converted),) = launch(1, app_losses, ["--float8"], corpus, timeout=120)
    split = launch(2, app_losses, ["--float8"], corpus, timeout=120)
    assert converted == 2 * 4  # 2 blocks × (qkv, proj, fc, out)
    assert sum(n for _, _, n in split) == converted
    for got, _, _ in split:
        assert all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(got, alone)), (got, alone)
