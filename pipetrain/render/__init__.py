"""Pictures of a ``Timeline``: a terminal timeline, an SVG Gantt chart and a Chrome/Perfetto trace.

Every renderer reads only ``pipetrain.schedule`` types, so simulated and measured timelines draw
the same way. ``style`` holds what they share (palette, ticks); layout belongs to each module.
"""

from pipetrain.render.svg import render_svg
from pipetrain.render.text import render_text
from pipetrain.render.trace import render_trace, write_trace

__all__ = ["render_svg", "render_text", "render_trace", "write_trace"]
