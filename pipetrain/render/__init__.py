"""Pictures of a ``Timeline``: a terminal timeline and memory chart, an SVG Gantt chart (memory
curves optional) and a Chrome/Perfetto trace.

Every renderer reads only ``pipetrain.schedule`` types, so simulated and measured timelines draw
the same way. ``style`` holds what they share (palette, ticks); layout belongs to each module.
"""

from pipetrain.render.memory_chart import render_memory_text
from pipetrain.render.svg import render_svg
from pipetrain.render.text import render_text
from pipetrain.render.trace import render_trace, write_trace

__all__ = ["render_memory_text", "render_svg", "render_text", "render_trace", "write_trace"]
