"""What the install files pull: one NIXL build, not the `nixl` meta
package's two (CUDA 12 and CUDA 13, about 230 MB each), and the meta
package's `import nixl` dispatcher beside it at the same version, without
its dependencies, in every install step (Makefile install and
package-check, the Ray node setup script)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_DEPS_NIXL = re.compile(r"pip install .*--no-deps .*(\$\(NIXL\)|nixl==(?P<version>[\d.]+))")


def _requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)(.*)", requirement).groups()  # type: ignore[union-attr]
        found[name.lower()] = spec
    return found


def test_the_project_requires_one_nixl_build_not_the_meta_package() -> None:
    requirements = _requirements()
    assert "nixl" not in requirements, "the nixl meta package pulls both CUDA builds"
    builds = [name for name in requirements if name.startswith("nixl-cu")]
    assert builds == ["nixl-cu12"]
    assert requirements["nixl-cu12"].startswith("=="), "the dispatcher is version-locked to it"


def test_every_install_step_adds_the_dispatcher_without_dependencies() -> None:
    version = _requirements()["nixl-cu12"].removeprefix("==")
    makefile = (ROOT / "Makefile").read_text()
    assert f"NIXL := nixl=={version}" in makefile
    recipes = [line for line in makefile.splitlines() if NO_DEPS_NIXL.search(line)]
    assert len(recipes) == 2  # install and package-check
    setup = (ROOT / "deploy" / "ray" / "setup-node.sh").read_text()
    match = NO_DEPS_NIXL.search(setup)
    assert match is not None and match["version"] == version
