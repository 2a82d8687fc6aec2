"""The command line: ``pipetrain schedules | show | simulate | compare | plan | profile | train |
demo``, one module per command (``*_command.py``), every flag and validator in ``flags``, the top
parser and the dispatch in ``commands``.

Input is validated here, at the edge: a bad value exits with status 2 and a one-line message,
never a traceback. The application and the runtime are imported inside the functions that need
them, so ``pipetrain --help`` and the planning commands never import torch.
"""

from pipetrain.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
