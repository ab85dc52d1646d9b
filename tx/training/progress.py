"""The trainers' progress bar on stderr: step / total, tokens/s, the current loss or reward, ETA (tqdm's).

The JSON metric lines stay on stdout; the bar is off where stderr is not a terminal unless asked for
(`--progress`), and off with `--no-progress`.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (step / total, tokens/s, loss or reward, ETA); default: on "
                             "when stderr is a terminal. --no-progress turns it off, --progress on everywhere")


def progress_bar(total: int, initial: int, desc: str, unit: str, enabled: bool | None) -> tqdm:
    """`enabled` None: on where stderr is a terminal."""
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                disable=None if enabled is None else not enabled)
