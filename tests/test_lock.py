"""The locked dependency set: what `make` installs is what `requirements/lock.txt` pins,
and the lock satisfies every requirement of `pyproject.toml` (dependencies and `dev`)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)(?:\s*;\s*([^\\]+?))?\s*\\?$")


def _locked() -> dict[str, Version]:
    """Each package the lock pins for this interpreter and platform: name -> version."""
    pins: dict[str, Version] = {}
    lines = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    for line in lines:
        m = PIN.match(line)
        if m is None:
            continue
        name, version, marker = m.groups()
        if marker and not Requirement(f"x; {marker}").marker.evaluate():  # type: ignore[union-attr]
            continue
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _required() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [
        Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]
    ]


def test_every_line_of_the_lock_carries_a_hash() -> None:
    text = (ROOT / "requirements" / "lock.txt").read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 6)[-1])
    pinned = [b for b in blocks if PIN.match(b.splitlines()[0])]
    assert len(pinned) >= 50
    for block in pinned:
        assert "--hash=sha256:" in block, block.splitlines()[0]


def test_the_lock_satisfies_pyproject() -> None:
    pins = _locked()
    env = default_environment()
    for req in _required():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in requirements/lock.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"lock pins {name}=={pins[name]}, outside {req}: run `make lock`"
        )


@pytest.mark.parametrize("name", ["transformers", "tokenizers", "torch", "safetensors", "numpy"])
def test_the_venv_runs_the_locked_oracle(name: str) -> None:
    """The packages the numerics are compared with are the lock's, not a newer release."""
    assert Version(metadata.version(name)) == _locked()[name]
