"""What the wheel installs can run on what it declares: every module of ``graftmerge/`` imports, and
every third-party import in it belongs to a distribution that pyproject.toml names (a top-level import
to ``dependencies``; an import made only inside a function, e.g. the optional lm-evaluation-harness,
at least to an extra). The wheel packages ``graftmerge`` and nothing else (experiments/ and tests/
stay in the repository)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: huggingface_hub installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graftmerge"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def normalized(name: str) -> str:
    """PEP 503: ``PyYAML``, ``pyyaml`` and ``py_yaml`` name one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(requirements: list[str]) -> set[str]:
    return {normalized(Requirement(line).name) for line in requirements}


REQUIRED = declared(PROJECT["project"]["dependencies"])
OPTIONAL = set().union(*(declared(lines) for lines in PROJECT["project"]["optional-dependencies"].values()))
DISTRIBUTIONS = importlib.metadata.packages_distributions()
MODULES = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for path in PACKAGE.rglob("*.py"))


def third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module name, line, at the module's top level) of each import not of the stdlib or graftmerge."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            if root not in sys.stdlib_module_names and root not in ("graftmerge", "__future__"):
                found.append((root, node.lineno, id(node) in top))
    return found


def undeclared(path: Path, root: Path = ROOT) -> list[str]:
    wrong = []
    for module, line, top in third_party_imports(path):
        distributions = {normalized(d) for d in DISTRIBUTIONS.get(module, [])}
        allowed = REQUIRED if top else REQUIRED | OPTIONAL
        if not distributions & allowed:
            where = f"{path.relative_to(root)}:{line}"
            wrong.append(f"{where} imports {module} (from {sorted(distributions) or 'no installed distribution'}), "
                         f"which pyproject.toml does not declare{'' if top else ' (nor any extra)'}")
    return wrong


def test_every_third_party_import_is_declared():
    wrong = [line for path in sorted(PACKAGE.rglob("*.py")) for line in undeclared(path)]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_undeclared_import(tmp_path: Path):
    """A control: an import of an installed but undeclared distribution (pytest) is caught; a lazy
    import of an extra's (lm_eval) passes; at the top of a module the extra is not enough."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nimport torch\nimport pytest\n\ndef f():\n    import lm_eval\n")
    assert [line.split(" imports ")[1].split(" ")[0] for line in undeclared(probe, tmp_path)] == ["pytest"]
    probe.write_text("import lm_eval\n")
    assert len(undeclared(probe, tmp_path)) == 1


@pytest.mark.parametrize("module", MODULES)
def test_every_module_of_the_wheel_imports(module: str):
    importlib.import_module(module)


def test_the_wheel_holds_the_package_only():
    wheel = PROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["graftmerge"]
    assert not (PACKAGE / "testing").exists() and (ROOT / "experiments" / "__init__.py").exists()
    assert not [m for m in MODULES if m.startswith(("graftmerge.testing", "experiments", "tests"))]
