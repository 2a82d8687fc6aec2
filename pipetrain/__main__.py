"""``python -m pipetrain`` runs the command line."""

from pipetrain.cli import main

raise SystemExit(main())
