"""Expert parallel on the mesh (``runtime.parallel.expert_parallel``): a tiny Qwen3-MoE on
gloo in float64, experts sharded over ``ep``, tokens dispatched and combined with all-to-all,
against the unsplit ``transformers`` model under gradient accumulation over the same
micro-batches: loss, router loss, gradient norm and every gradient (clipped) to 1e-10."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from expert_parallel_cases import run_exact, run_families, run_reshard
from runtime_harness import launch

#: (schedule, loss reduction, data parallel): the global token mean sums the replicas'
#: gradients, a mean of micro-batch means averages them (the experts divided by edp × ep);
#: FSDP2 shards the dense parameters over edp × ep, the experts stay expert parallel's
CASES = [("zbv", "token_mean", "ddp"), ("dualpipev", "mean", "fsdp")]


@pytest.mark.slow
def test_pp2_dp2_ep2_zbv_and_dualpipev_are_exact() -> None:
    """pp 2 × dp 2 with ep 2 (4 processes): one ep group per stage, no edp replicas."""
    assert launch(4, run_exact, 1, 2, CASES, timeout=300) == [[]] * 4


@pytest.mark.stress
@pytest.mark.slow
def test_pp2_dp4_ep2_zbv_and_dualpipev_are_exact() -> None:
    """pp 2 × dp 4 with ep 2 (8 processes): experts reduced over edp 2, dense over all 4."""
    assert launch(8, run_exact, 2, 2, CASES, timeout=600) == [[]] * 8


@pytest.mark.slow
def test_a_checkpoint_at_ep2_loads_at_ep1_and_exports_to_transformers(tmp_path) -> None:
    assert launch(4, run_reshard, str(tmp_path), timeout=300) == [[]] * 4


class _Names:
    """Just enough of a DeviceMesh for what is refused before any group is made."""

    def __init__(self, *names: str, size: int = 2) -> None:
        self.mesh_dim_names = names
        self._size = size

    def size(self, dim: int = 0) -> int:
        return self._size


@pytest.mark.parametrize(
    ("names", "kind", "message"),
    [
        (("pp", "ep"), "ddp", "needs both 'edp' and 'ep'"),
        (("pp", "dp", "edp", "ep"), "ddp", r"'dp', \('dp_replicate', 'dp_shard'\) or"),
        (("pp", "edp", "ep", "tp"), "ddp", "needs expert tensor parallel"),
        (("pp", "edp", "ep"), None, "mesh= and data_parallel= go together"),
    ],
)
def test_meshes_expert_parallel_cannot_run_are_refused(names, kind, message) -> None:
    from pipetrain.runtime.parallel.mesh import resolve_mesh

    with pytest.raises(ValueError, match=message):
        resolve_mesh(_Names(*names), kind)


def test_experts_an_ep_does_not_divide_are_refused() -> None:
    import transformers as tf

    from pipetrain.runtime.parallel.expert_parallel import ExpertParallelExperts

    config = tf.Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4)
    experts = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with pytest.raises(ValueError, match=r"--ep 3 must divide the number of experts \(4\)"):
        ExpertParallelExperts(experts, _Names("edp", "ep", size=3))
    with pytest.raises(ValueError, match=r"a \('edp', 'ep'\) mesh"):
        ExpertParallelExperts(experts, _Names("ep"))


@pytest.mark.slow
def test_every_family_shards_its_experts_exactly() -> None:
    """Qwen2-MoE (shared expert), Mixtral, GPT-OSS (biases, clamped interleaved gate) and
    DeepSeek-V3 (grouped routing with its bias) on ep 2 without a pipeline: logits and gradients
    against the unsplit model."""
    kinds = ["qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3"]
    assert launch(2, run_families, kinds) == [[], []]
