"""requirements.lock, which `make venv` installs before r3jax itself (without resolving), pins every
requirement of pyproject.toml that the test venv installs, at a version its specifier admits, and
the venv running these tests has those versions."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> list[str]:
    return re.search(r"^EXTRAS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split(",")


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_requirement_is_pinned_at_an_admitted_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in _extras():
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    pins = _pins()
    for req in reqs:
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"{req} is not in requirements.lock (run `make lock`)"
        assert req.specifier.contains(pinned, prereleases=True), f"requirements.lock pins {req.name}=={pinned}: {req}"


def test_the_test_venv_has_the_locked_versions():
    for name, version in _pins().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            raise AssertionError(f"{name}=={version} is locked but not installed (run `make venv`)") from None
        assert installed == version, f"{name}: installed {installed}, locked {version} (run `make venv`)"
