"""Planning from measured costs: the costs file, contiguous layer cuts, and the search over
schedule, stages per rank, micro-batches and boundaries judged by the simulator (standard
library only; docs/planning.md).

The formats (``layout``, ``costs_file``, ``recompute_modes``) are what the runtime and ``hf`` may
read of the planner (tests/test_rules.py holds it); they import nothing of the search
(``search``, ``judge``, ``cuts``, ...), which makes plans.
"""

from pipetrain.planner.costs_file import (
    CostsFileError,
    LayerCost,
    ModelCosts,
    load_costs,
    parse_costs,
    save_costs,
)
from pipetrain.planner.layout import Layout, default_cut
from pipetrain.planner.search import NoPlanFits, Plan, Search, plan, search

__all__ = [
    "CostsFileError",
    "LayerCost",
    "Layout",
    "ModelCosts",
    "NoPlanFits",
    "Plan",
    "Search",
    "default_cut",
    "load_costs",
    "parse_costs",
    "plan",
    "save_costs",
    "search",
]
