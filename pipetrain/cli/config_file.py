"""``pipetrain train --config FILE.toml``: the command's flags read from a TOML file.

Each key names a flag as its destination (``seq_len = 2048``) or as spelled without its dashes
(``"seq-len" = 2048``; an alias such as ``text`` names its flag's destination, ``data``). The
file's values become the parser's defaults, so a flag given on the command line overrides the
file and the file overrides the built-in default. A value is checked as the flag checks its text
(a number's range, a choice's legal names), and its TOML type must be the flag's: an integer
for a count, a number for a rate, a string for a path or a name, true or false for a switch, so
``steps = "10"`` is refused rather than read. An unknown key is refused naming the closest legal
one (Python's ``difflib``), not ignored: a misspelt flag would otherwise fall back to its
default without a word.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipetrain.cli.flags import Option, positive_float, receive_lead
from pipetrain.cli.train_options import non_negative_float

#: destinations that a file cannot set: the file itself, and the launcher's own
_NOT_IN_FILES = ("config", "worker", "schedule_positional")


def read_config(path: str, options: Sequence[Option]) -> dict[str, Any]:
    """The flags of the TOML file ``path`` by destination, each checked against ``options``;
    ``ValueError`` naming the file and the key otherwise."""
    flag = f"--config {path}"
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} is not TOML ({e})") from None
    by_name = _names(options)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        opt = by_name.get(key.replace("-", "_"))
        if opt is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(by_name), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{flag}: unknown key {key!r}{hint} (keys are train's flags)")
        if opt.dest in values:
            raise ValueError(f"{flag}: {key!r} sets {opt.flags[0]} a second time")
        try:
            values[opt.dest] = _checked(opt, value)
        except (argparse.ArgumentTypeError, TypeError) as e:
            raise ValueError(f"{flag}: {key}: {e}") from None
    return values


def _names(options: Sequence[Option]) -> dict[str, Option]:
    """Every long spelling of a flag, without dashes, to its option."""
    return {
        spelling[2:].replace("-", "_"): opt
        for opt in options
        if opt.dest not in _NOT_IN_FILES
        for spelling in opt.flags
        if spelling.startswith("--")
    }


def _checked(opt: Option, value: Any) -> Any:
    """``value`` as the flag would parse it; ``TypeError`` for a TOML value of another type."""
    if opt.switch:
        if type(value) is not bool:
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if opt.type is receive_lead and value == "none":
        return None
    if opt.type in (positive_float, non_negative_float):
        if type(value) not in (int, float):
            raise TypeError(f"expected a number, got {value!r}")
    elif opt.type is not None:
        if type(value) is not int:
            raise TypeError(f"expected an integer, got {value!r}")
    elif type(value) is not str:
        raise TypeError(f"expected a string, got {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise TypeError(f"expected one of {', '.join(opt.choices)}, got {value!r}")
    return opt.type(str(value)) if opt.type is not None else value


__all__ = ["read_config"]
