"""Headline figures that a benchmark hands to ``run_all.py``.

Each figure is a ratio or a difference measured in one run, with the target
it must not exceed, so that one summary table and one plot can cover every
benchmark.
"""

from __future__ import annotations

import argparse
import json


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the headline figures (measured vs target) to PATH",
    )


def write(path: str | None, benchmark: str, figures: dict[str, tuple]) -> None:
    """Writes ``{name: (measured, target)}``; met means measured <= target."""
    if path is None:
        return
    with open(path, "w") as file:
        json.dump(
            {
                "benchmark": benchmark,
                "figures": [
                    {"name": name, "measured": float(measured), "target": float(target)}
                    for name, (measured, target) in figures.items()
                ],
            },
            file,
            indent=2,
        )
