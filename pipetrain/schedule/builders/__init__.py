"""One builder per schedule family: a spec's shape in, a compute-only ``Program`` out.

Each builder is written the way its paper draws it — numbered phases with named warm-up counts —
and refuses shapes it cannot build with a ``ValueError`` that names the legal values.
"""
