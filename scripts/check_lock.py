"""Checks that requirements.lock still agrees with pyproject.toml (run by `make test`, offline).

A development tool, not part of either process. The lock is written by `make lock` (uv pip compile);
this script reads both files and fails with one clear message per disagreement:
- a dependency of pyproject.toml (the package's, or of its `test`/`bench` extras) is missing from the
  lock, or its pinned version no longer satisfies the range pyproject.toml asks for;
- the lock names a package as a direct dependency of the project that pyproject.toml no longer lists.
torch is the one exception: the Makefile pins it (a CPU build) and installs it before the lock.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# Installed by the Makefile's TORCH pin, not from the lock (the lock holds torch's own dependencies).
PINNED_OUTSIDE_THE_LOCK = {"torch"}
LOCKED_EXTRAS = ("test", "bench")
# The platform the lock is resolved for (`make lock`): markers are judged as they would be there.
LOCK_ENVIRONMENT = {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
PIN_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
PROJECT_SOURCE = "(pyproject.toml)"


def project_requirements(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    texts = list(project.get("dependencies", []))
    for extra in LOCKED_EXTRAS:
        texts += project.get("optional-dependencies", {}).get(extra, [])
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(LOCK_ENVIRONMENT)]


def locked_pins(lock: Path) -> tuple[dict[str, Version], set[str]]:
    """The lock's pins, and the names it says pyproject.toml asked for directly (uv's `# via` notes)."""
    pins: dict[str, Version] = {}
    direct: set[str] = set()
    current: str | None = None
    for line in lock.read_text().splitlines():
        match = PIN_LINE.match(line)
        if match:
            current = canonicalize_name(match.group(1))
            pins[current] = Version(match.group(2))
        elif current and line.lstrip().startswith("#") and PROJECT_SOURCE in line:
            direct.add(current)
    return pins, direct


def disagreements(pyproject: Path, lock: Path) -> list[str]:
    pins, direct = locked_pins(lock)
    problems = []
    wanted = set()
    for requirement in project_requirements(pyproject):
        name = canonicalize_name(requirement.name)
        wanted.add(name)
        if name in PINNED_OUTSIDE_THE_LOCK:
            continue
        if name not in pins:
            problems.append(f"{requirement} is in {pyproject.name} but not in {lock.name}")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(
                f"{lock.name} pins {name}=={pins[name]}, outside {pyproject.name}'s {requirement}"
            )
    for name in sorted(direct - wanted):
        problems.append(f"{lock.name} still holds {name} for {pyproject.name}, which no longer asks for it")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--lock", type=Path, default=Path("requirements.lock"))
    args = parser.parse_args(argv)
    if not args.lock.is_file():
        print(f"{args.lock} is missing: run `make lock` and commit it", file=sys.stderr)
        return 1
    problems = disagreements(args.pyproject, args.lock)
    for problem in problems:
        print(f"lock check: {problem}", file=sys.stderr)
    if problems:
        print(
            f"{args.lock} disagrees with {args.pyproject}: run `make lock` and commit both", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
