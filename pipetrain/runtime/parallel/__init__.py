"""The job's dimensions besides the pipeline (the mesh, data parallel, tied weights, the global
gradient norm). Stands on ``comm`` and ``backward``; docs/design.md's "File map" lists its
modules."""
