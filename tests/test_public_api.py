"""The public Python API stays put (docs/api-policy.md).

Every name ``graftmerge`` exports resolves through its one-line map entry and loads only
when used, so the ``.pth`` hook and ``graftmerge --help`` stay light; every import the
docs' Python snippets show works from the path they show, and that path is the public
one; docs/api-policy.md lists every export.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import graftmerge

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mergekit", "transformers", "safetensors", "peft", "huggingface_hub")
# Where the docs are: discovered when the tests run, whoever edits them.
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "fisher").rglob("*.md"))]


@pytest.mark.parametrize("name", sorted(graftmerge._EXPORTS))
def test_every_export_resolves_to_its_map_entry(name):
    module, attribute = graftmerge._EXPORTS[name].split(":")
    assert getattr(graftmerge, name) is getattr(importlib.import_module(module), attribute)


def test_all_dir_and_star_import_list_every_export():
    assert graftmerge.__all__ == sorted(graftmerge._EXPORTS)
    assert set(graftmerge.__all__) <= set(dir(graftmerge))
    namespace: dict = {}
    exec("from graftmerge import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(graftmerge.__all__)
    with pytest.raises(AttributeError, match="no attribute 'fisher_cache'"):
        graftmerge.fisher_cache  # noqa: B018 - an internal module is not a public name
    with pytest.raises(ImportError):
        exec("from graftmerge import open_delta", {})


def test_type_checkers_see_exactly_the_exports():
    """The ``if TYPE_CHECKING:`` imports in graftmerge/__init__.py name the same targets as the map."""
    tree = ast.parse((ROOT / "graftmerge" / "__init__.py").read_text(encoding="utf-8"))
    blocks = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    assert len(blocks) == 1
    seen = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        seen |= {alias.asname or alias.name: f"{node.module}:{alias.name}" for alias in node.names}
    assert seen == graftmerge._EXPORTS


def run_python(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def test_import_graftmerge_loads_nothing_until_a_name_is_used():
    """Without site (no .pth hook): the package alone, then __all__ and dir(), load no other module."""
    code = (
        "import sys\nbefore = set(sys.modules)\nimport graftmerge\nprint(sorted(set(sys.modules) - before))\n"
        "graftmerge.__all__, dir(graftmerge), graftmerge.__version__\nprint(sorted(set(sys.modules) - before))\n"
    )
    assert run_python("-S", "-c", code) == ["['graftmerge']", "['graftmerge']"]


def test_heavy_modules_load_only_when_a_public_name_is_used():
    code = (
        "import sys\nimport graftmerge\n"
        f"heavy = lambda: sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(heavy())\ngraftmerge.__all__, dir(graftmerge)\nprint(heavy())\n"
        "from graftmerge import FisherCacheWriter\nprint('torch' in heavy(), 'mergekit' in heavy())\n"
    )
    assert run_python("-c", code) == ["[]", "[]", "True False"]


def python_blocks(file: Path):
    """(first line number, code) of every fenced ```python block, list-item indentation removed."""
    lines = file.read_text(encoding="utf-8").splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        fence = line.strip()
        if start is None and fence.startswith("```") and fence[3:].strip().split(" ")[0] in ("python", "py"):
            start, body = number + 1, []
        elif start is not None and fence == "```":
            yield start, textwrap.dedent("\n".join(body))
            start = None
        elif start is not None:
            body.append(line)


def graftmerge_imports(code: str) -> list[ast.stmt]:
    """The ``import graftmerge…`` / ``from graftmerge… import …`` statements of a snippet (one
    statement at a time where the whole snippet is not valid Python, e.g. has placeholders)."""
    try:
        trees = [(0, ast.parse(code))]
    except SyntaxError:
        trees, lines = [], code.splitlines()
        for index, line in enumerate(lines):
            if line.lstrip().startswith(("import ", "from ")):
                for end in range(index + 1, min(index + 20, len(lines)) + 1):
                    try:
                        trees.append((index, ast.parse(textwrap.dedent("\n".join(lines[index:end])))))
                        break
                    except SyntaxError:
                        continue
    found = []
    for offset, tree in trees:
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name.split(".")[0] == "graftmerge" for name in names):
                node.lineno += offset
                found.append(node)
    return found


def documented_imports() -> list:
    cases = []
    for file in DOC_FILES:
        for start, code in python_blocks(file):
            for node in graftmerge_imports(code):
                where = f"{file.relative_to(ROOT)}:{start + node.lineno - 1}"
                cases.append(pytest.param(ast.unparse(node), id=f"{where}: {ast.unparse(node)}"))
    return cases


DOCUMENTED = documented_imports()


@pytest.mark.parametrize("statement", DOCUMENTED)
def test_documented_import_works_as_written(statement):
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="graftmerge", category=DeprecationWarning)
        exec(statement, namespace)
    node = ast.parse(statement).body[0]
    for alias in node.names:
        assert (alias.asname or alias.name).split(".")[0] in namespace


@pytest.mark.parametrize("statement", DOCUMENTED)
def test_documented_import_uses_the_public_path(statement):
    """Docs show ``from graftmerge import X``; internal modules move without notice.
    (``graftmerge.demo`` is the demo's models, shown in the real-model walkthrough, docs/smollm2.md.)"""
    node = ast.parse(statement).body[0]
    modules = [node.module] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
    internal = [m for m in modules if m != "graftmerge" and not m.startswith("graftmerge.demo")]
    assert not internal, (
        f"show `from graftmerge import ...` (add the name to graftmerge._EXPORTS if it is public): {statement}"
    )


def test_the_old_fisher_alias_is_gone():
    """0.1.0 had no users to protect: ``graftmerge.fisher`` went with it (from graftmerge import ...)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("graftmerge.fisher")


def test_the_policy_page_lists_every_export():
    """docs/api-policy.md's table of public names names each export, and nothing else in backticks of its first
    column."""
    page = (ROOT / "docs" / "api-policy.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("   | `")]
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == set(graftmerge.__all__)


def test_the_api_reference_renders_every_export_from_where_it_lives():
    """docs/reference.md has one ``:::`` entry per public name, at the path the export map names,
    so the reference can neither miss a name nor point at a module it moved out of."""
    page = (ROOT / "docs" / "reference.md").read_text()
    rendered = set(re.findall(r"^::: ([\w.]+)$", page, flags=re.M))
    expected = {target.replace(":", ".") for target in graftmerge._EXPORTS.values()}
    assert rendered == expected
