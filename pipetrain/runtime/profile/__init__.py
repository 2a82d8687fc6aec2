"""The profiler: measuring a model's layers on the device they will train on, for the planner's
costs file (``planner.costs_file``). ``profile_layers.profile`` is its entry point; the clocks
that time a piece of work (``profile_clock``, ``profile_replay``), the recompute times
(``profile_recompute``), the memory counts (``profile_memory``) and the host link's speed
(``host_link``) are its parts. It stands on the stage wrappers (``runtime.stage``,
``backward``), never the other way round: nothing that trains imports the profiler.
"""
