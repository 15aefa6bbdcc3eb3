"""Headline figures that a benchmark hands to ``run_all.py``.

Each figure is a ratio or a difference measured in one run, with the target
it must not exceed, so that one summary table can cover every benchmark;
the measurements behind them travel alongside, for the plots.
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


def write(
    path: str | None,
    benchmark: str,
    figures: dict[str, tuple],
    data: dict | None = None,
) -> None:
    """Writes ``{name: (measured, target)}``; met means measured <= target.

    ``data``, if given, is written as is under ``"data"``: the measurements
    behind the figures, for the plots of ``run_all.py``.
    """
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
                "data": data or {},
            },
            file,
            indent=2,
        )
