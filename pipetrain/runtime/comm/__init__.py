"""Between ranks: transfers, agreement, failures that reach every rank, leaving together. The
runtime's floor: it imports only ``runtime.torch_compat``; docs/design.md's "File map" lists its
modules."""
