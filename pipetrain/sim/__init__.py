"""Cost model, discrete-event simulation and closed-form formulas (standard library only)."""

from pipetrain.sim.costs import Costs, StageCosts
from pipetrain.sim.simulate import simulate

__all__ = ["Costs", "StageCosts", "simulate"]
