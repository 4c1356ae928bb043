"""The version floors pyproject.toml declares, read back at run time so that they are written once.

`finetune doctor` and `finetune train`'s preflight check the installed libraries against what
`pip install 'finetune[EXTRA]'` asks for. They read it from the installed distribution's metadata
(`importlib.metadata.requires("finetune")`, the `Requires-Dist` lines pip wrote from pyproject.toml);
in a source checkout that was never installed, from pyproject.toml itself. Versions are compared
the way `pip check` compares them (PEP 440, pre-releases and local builds included), with
`packaging`, the library pip vendors for it.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Optional

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from finetune.errors import FinetuneError

DISTRIBUTION = "finetune"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


class RequirementsError(FinetuneError):
    """The package's own requirements cannot be read (a broken install or pyproject.toml)."""


def declared_requirements() -> list[Requirement]:
    """Every requirement of the package, extras marked as pip marks them (`extra == "train"`)."""
    try:
        lines = importlib.metadata.requires(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return pyproject_requirements(PYPROJECT)
    try:
        return [Requirement(line) for line in lines or ()]
    except InvalidRequirement as exc:
        raise RequirementsError(f"the installed {DISTRIBUTION} metadata holds a bad requirement: {exc}") from None


def python_requirement() -> SpecifierSet:
    """The Python versions the package supports (`requires-python`)."""
    try:
        text = importlib.metadata.metadata(DISTRIBUTION)["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        try:
            text = _load_toml(PYPROJECT)["project"]["requires-python"]
        except (OSError, KeyError, ValueError) as exc:
            raise RequirementsError(f"{PYPROJECT}: cannot read requires-python ({exc})") from None
    return SpecifierSet(text or "")


def pyproject_requirements(path: Path) -> list[Requirement]:
    """What the metadata would say, read from pyproject.toml (a checkout run without installing it)."""
    try:
        data = _load_toml(path)
        project = data["project"]
        found = [Requirement(text) for text in project.get("dependencies", ())]
        for extra, texts in project.get("optional-dependencies", {}).items():
            found += [_in_extra(Requirement(text), extra) for text in texts]
    except (OSError, KeyError, ValueError, InvalidRequirement) as exc:
        raise RequirementsError(f"{path}: cannot read the package's requirements ({exc})") from None
    return found


def _load_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as the `tomli` backport (a dependency there)
        import tomli as tomllib
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def _in_extra(requirement: Requirement, extra: str) -> Requirement:
    """The requirement as pip writes it for an extra: its own marker (if any) and `extra == NAME`."""
    own = f"({requirement.marker}) and " if requirement.marker else ""
    requirement.marker = Marker(f'{own}extra == "{extra}"')
    return requirement


def floors(extra: str, requirements: Optional[list[Requirement]] = None) -> dict[str, SpecifierSet]:
    """Canonical name -> version specifier of what `finetune[extra]` adds to the base install, on
    this interpreter and platform (environment markers evaluated)."""
    requirements = declared_requirements() if requirements is None else requirements
    found: dict[str, SpecifierSet] = {}
    for requirement in requirements:
        if requirement.marker is None:
            continue  # a base dependency, not the extra's
        if requirement.marker.evaluate({"extra": extra}) and not requirement.marker.evaluate({"extra": ""}):
            name = canonicalize_name(requirement.name)
            found[name] = found.get(name, SpecifierSet()) & requirement.specifier
    return found


def extra_floors(extra: str) -> dict[str, str]:
    """floors(extra) as text: `{"peft": ">=0.14", ...}`."""
    return {name: str(spec) for name, spec in floors(extra).items()}


def satisfies(version: str, spec: str) -> bool:
    """Whether an installed `version` meets `spec` ('0.43.1' and '>=0.43.3': no).

    Pre-releases count (an installed 0.19.8.dev0 meets >=0.15.4 but not >=0.19.8), as in `pip check`;
    a version PEP 440 cannot parse counts as too old, so that it is looked at."""
    try:
        specifier = SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(f"unsupported version spec {spec!r}") from None
    try:
        return specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False
