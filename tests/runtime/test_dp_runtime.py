"""Data parallel under the pipeline: a ("dp", "pp") mesh of 2 × 2 gloo ranks, DDP and FSDP2,
float64 against the unsplit model on the global batch; one reduction per stage per step."""

from __future__ import annotations

import pytest
from dp_cases import run_data_parallel
from runtime_harness import launch

STEPS = 2
# (kind, schedule, defer_weight_grads): 1F1B-family B, I/W split by graph replay and by
# deferred linear GEMMs, V placements (both stages on one rank) and DualPipeV's F&B pairs.
CASES = [
    (kind, name, defer)
    for kind in ("ddp", "fsdp")
    for name, defer in [
        ("1f1b", False),
        ("interleaved-1f1b", None),
        ("zb-h1", True),
        ("zbv", False),
        ("zbv", True),
        ("dualpipev", None),
    ]
] + [
    ("fsdp-nested", "zbv", True),  # fully_shard applied inside the stages by the caller
    ("ddp-tokens", "zbv", True),  # "token_mean": the count spans both replicas
    ("fsdp-tokens", "1f1b", None),
    ("ddp-sum", "1f1b", None),  # loss_reduction="sum": replicas summed, not averaged
    ("fsdp-sum", "interleaved-1f1b", False),
    # GPT-2's tied embedding/head under DDP (runtime.parallel.tied reduces it over owners x replicas)
    ("ddp-tied", "1f1b", None),
    ("ddp-tied", "interleaved-1f1b", False),
    ("ddp-tied", "zbv", True),  # both uses on rank 0: one Parameter object
    ("ddp-tied", "dualpipev", None),
    ("ddp-tied-tokens", "zbv", False),  # "token_mean": summed over the replicas, not averaged
    # ... and under FSDP2, which keeps tied parameters whole (fully_shard's ignored_params)
    ("fsdp-tied", "1f1b", None),
    ("fsdp-tied", "interleaved-1f1b", False),
    ("fsdp-tied", "zbv", True),
]


@pytest.fixture(scope="module")
def results():
    return launch(4, run_data_parallel, CASES, timeout=240)


@pytest.mark.slow
def test_ddp_and_fsdp2_match_unsplit_training_on_the_global_batch(results):
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)
    # mesh ranks 0, 2 are pp rank 0 of replicas 0 and 1 (the last case is interleaved-1f1b)
    assert results[0]["stages"] == results[2]["stages"] == [0, 2]
    assert results[1]["stages"] == results[3]["stages"] == [1, 3]


@pytest.mark.slow
def test_gradients_are_reduced_once_per_stage_per_step(results):
    from pipetrain.schedule.registry import family

    for r in results:
        for (kind, name, defer), count in zip(CASES, r["syncs"].values()):
            local = family(name).default_stages_per_rank
            if kind == "ddp":  # one bucket per stage: one all-reduce per step
                assert count == dict.fromkeys(count, STEPS) and len(count) == local, name
            elif kind == "fsdp":  # one reduce-scatter per stage per step
                assert count == STEPS * local, (name, defer)
            elif kind == "fsdp-nested":  # and one per sharded layer inside it
                assert count == 2 * STEPS * local, (name, defer)
            elif kind == "ddp-tied":  # three steps; a stage of tied weights alone has no DDP
                assert set(count.values()) <= {STEPS + 1}, (name, count)


@pytest.mark.slow
def test_what_cannot_be_exact_is_refused(results):
    for r in results:
        e = r["errors"]
        assert e["mesh_alone"].startswith("PipelineRefused: mesh= and data_parallel= go together")
        assert "legal values: ddp, fsdp" in e["bad_kind"]
        assert "either group= or mesh=" in e["group_and_mesh"]
        assert "wrapped in DistributedDataParallel" in e["wrapped_ddp"]
        assert "data_parallel='fsdp'" in e["fsdp_without_mesh"]
        assert "local batches of 9 to 10 rows" in e["unequal_batches"]
        assert (
            "PipelineRefused: tied weight 'embed.weight' is a sharded DTensor" in e["tied_sharded"]
        )
        for kind in ("ddp", "fsdp"):
            assert "'spare' got no gradient" in e[f"unused_{kind}"], e[f"unused_{kind}"]
