"""What ``Pipeline.from_plan`` checks of a plan against the run it is handed to, before any
transfer: a plan was priced for its shape, so a run of another shape would not be the plan's.

- An N-D plan (``planner.nd_search``: ``tp`` and ``dp`` given) runs only on a mesh of those
  tensor- and data-parallel sizes (``"tp"``; ``"dp"``, or HSDP's ``"dp_replicate"`` ×
  ``"dp_shard"``; a dimension the mesh lacks, or no mesh, is size 1), as ``pipetrain train
  --plan`` holds its ``--tp`` and ``--dp`` to the plan's. A pipeline-only plan leaves both to
  the run.
- A plan that carries its program (a synthesized schedule) runs on as many pipeline ranks as the
  program has: its order was built for them, so no other count can run it.

Every rank reads the same plan and the same mesh, so every rank refuses alike (nothing waits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from pipetrain.planner.layout import Layout
from pipetrain.runtime.parallel.mesh import DATA, HSDP, PIPELINE, TENSOR
from pipetrain.runtime.resolve import require_process_group


def check_plan_fits_run(layout: Layout, options: Mapping[str, Any]) -> None:
    """Refuse (``ValueError``, one line naming both) a plan whose tensor- or data-parallel size
    differs from the mesh's in ``options`` (``Pipeline``'s keyword arguments), or whose program
    has another number of ranks than the pipeline's process group (the mesh's ``"pp"``)."""
    mesh = options.get("mesh")
    if layout.tp is not None or layout.dp is not None:
        planned = (layout.tp or 1, layout.dp or 1)
        found = mesh_sizes(mesh)
        if planned != found:
            where = "the mesh has" if mesh is not None else "the run has no mesh= (so"
            close = "" if mesh is not None else ")"
            raise ValueError(
                f"the plan is for tp {planned[0]} × dp {planned[1]} but {where} tp {found[0]} × "
                f"dp {found[1]}{close}; pass mesh=init_device_mesh(..., mesh_dim_names=('pp', "
                "'dp', 'tp')) of the plan's sizes, or plan again for this mesh"
            )
    program = layout.program
    if program is None:
        return
    require_process_group()
    world = mesh[PIPELINE].size() if mesh is not None else dist.get_world_size(options.get("group"))
    if program.num_ranks != world:
        raise ValueError(
            f"the plan's program ({program.name}) runs on {program.num_ranks} pipeline ranks but "
            f"the process group has {world}; launch {program.num_ranks} processes per pipeline, "
            f"or synthesize again with --ranks {world}"
        )


def mesh_sizes(mesh: Any) -> tuple[int, int]:
    """The tensor- and data-parallel sizes of ``mesh`` (HSDP's pair: their product); 1 for a
    dimension it lacks, and (1, 1) for no mesh."""
    if mesh is None:
        return 1, 1
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    tp = mesh[TENSOR].size() if TENSOR in names else 1
    dp = 1
    for name in (DATA, *HSDP):
        if name in names:
            dp *= mesh[name].size()
    return tp, dp
