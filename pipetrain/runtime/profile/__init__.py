"""The profiler: a model's layers measured on the device they will train on, written as the
planner's costs file (``planner.costs_file``); ``profile_layers.profile`` is its entry point.
The runtime's roof: it stands on the stage runner and the sub-packages below, and nothing that
trains imports it; docs/design.md's "File map" lists its modules."""
