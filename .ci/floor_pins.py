"""Prints pip constraints pinning each core dependency at its declared floor.

pyproject.toml is the one place the floors are written: every entry of
[project].dependencies must read "name>=version", or "name>=version,<version"
where a later release is known to break the package, and becomes
"name==version" here, so the versions CI installs cannot drift from the ones
users are told work.

Usage: python .ci/floor_pins.py [path/to/pyproject.toml] > floors.txt
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

_VERSION = r"[0-9][0-9A-Za-z.]*"
_FLOOR = re.compile(
    rf"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*({_VERSION})(?:\s*,\s*<\s*{_VERSION})?$"
)


def floor_pins(pyproject: pathlib.Path) -> list[str]:
    """The "name==floor" pins of pyproject's core dependencies, in order."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = []
    for requirement in dependencies:
        match = _FLOOR.match(requirement.strip())
        if match is None:
            raise SystemExit(
                f"{pyproject}: core dependency {requirement!r} is not of the form "
                "'name>=version' or 'name>=version,<version'; CI installs each core "
                "dependency at its floor, so each needs exactly one, with at most "
                "an exclusive ceiling beside it and no marker."
            )
        pins.append(f"{match[1]}=={match[2]}")
    return pins


if __name__ == "__main__":
    default = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default
    print("\n".join(floor_pins(path)))
