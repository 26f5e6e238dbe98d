"""Print `name==version` for each requirement line, the version taken from a uv.lock.

    python scripts/uv_lock_pins.py UV_LOCK REQUIREMENTS_FILE [--no-deps]

A bare name (extras allowed: `ray[default]`) is pinned to the version uv.lock records for it from
a package registry; where uv.lock holds several (forks per extra), the lowest. A local version
label (`2.11.0+cu130`, the CUDA index's) is dropped: the package index serves the plain release.
A line that already pins (`name==1.2`) is printed as it is. Lines marked `# no-deps` are printed
only with --no-deps, the others only without it. Comments and blank lines are skipped. A bare name
uv.lock does not hold is an error naming it.
"""

from __future__ import annotations

import re
import sys
import tomllib


def _key(version: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"[.+]", version)]


def registry_versions(lock_path: str) -> dict[str, list[str]]:
    with open(lock_path, "rb") as f:
        lock = tomllib.load(f)
    versions: dict[str, list[str]] = {}
    for package in lock["package"]:
        if "registry" in package.get("source", {}):
            versions.setdefault(package["name"], []).append(package["version"])
    return versions


def pins(lock_path: str, requirements_path: str, no_deps: bool) -> list[str]:
    versions = registry_versions(lock_path)
    out = []
    for raw in open(requirements_path):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line or ("no-deps" in comment) != no_deps:
            continue
        if "==" in line:
            out.append(line)
            continue
        name = re.split(r"\[", line)[0]
        found = versions.get(name.lower().replace("_", "-"))
        if not found:
            sys.exit(f"{requirements_path}: {name} is not a registry package in {lock_path}")
        out.append(f"{line}=={sorted(found, key=_key)[0].split('+')[0]}")
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-deps"]
    if len(args) != 2:
        sys.exit(__doc__)
    print("\n".join(pins(args[0], args[1], "--no-deps" in sys.argv)))
