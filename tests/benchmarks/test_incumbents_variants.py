"""incumbents_runners.pipetrain_options: a row's name gives its Pipeline options; variants join
with '-' where they set different options, and a name that does not parse is refused with the
legal ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.incumbents.incumbents_runners import pipetrain_options


def test_variants_give_their_options_alone_and_joined() -> None:
    assert pipetrain_options("pipetrain") == {}
    assert pipetrain_options("pipetrain-nodefer") == {"defer_weight_grads": False}
    assert pipetrain_options("pipetrain-lead0") == {"receive_lead": 0}
    assert pipetrain_options("pipetrain-nodefer-lead0") == {
        "defer_weight_grads": False,
        "receive_lead": 0,
    }
    assert pipetrain_options("pipetrain-graph-leadnone") == {
        "cuda_graph": True,
        "receive_lead": None,
    }


def test_a_variant_that_does_not_parse_or_sets_an_option_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="nodefer,leadnone,graph,samecut,leadN"):
        pipetrain_options("pipetrain-fast")
    with pytest.raises(ValueError, match=r"sets \['receive_lead'\] twice"):
        pipetrain_options("pipetrain-lead0-leadnone")
