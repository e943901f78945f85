"""The package's shape, checked: imports point down the layers, no cycles, documented;
and the test suite's: no test module imports another (shared code is in tests/helpers/).

The layers, lowest first (docs/architecture.md draws them). A module may import
its own package and any package of a lower layer; packages that share a layer do
not import each other. Imports sit at the top of their module, except in the
places whose laziness keeps start-up fast: ``cli/`` (``graftmerge --help``
must not import torch), the ``.pth`` import hook (it runs in every Python) and the
lm-evaluation-harness bridge (an optional extra, imported only for ``lm_eval`` entries).
``graftmerge/__init__.py`` re-exports the public API from every layer without importing
it: names load on first use, and its ``if TYPE_CHECKING:`` imports never run, so they are
not edges of the import graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "graftmerge"

LAYERS: list[set[str]] = [
    {"", "errors"},  # __init__.py (version, lazy public API), the one exception type
    {"mergekit_compat"},  # adapter/mergekit_compat.py: every contact with mergekit's internals
    {"math"},  # pure tensors in, tensors out
    {"formats"},  # files on disk: checkpoints, Fisher caches, delta folders, GGUF
    {"hub"},  # the same artifacts on the Hugging Face Hub
    {"pipeline", "estimate"},  # a graft config -> a model; rollouts -> a Fisher cache
    {"evaluation"},  # task files; a model in memory -> scores per task and role
    {"methods"},  # graft, fisher, regmean as mergekit merge methods, one module each
    {"adapter"},  # their one registration with mergekit, its run_merge wrapped once, and the import hook
    {"demo"},  # `graftmerge demo`: generated tiny models and the paper's minimal model
    {"api"},  # the user's three jobs as functions: merge, estimate_fisher, sweep
    {"cli"},  # click commands; graftmerge/__main__.py (python -m graftmerge) belongs here
]
LAZY_IMPORTS_ALLOWED = ("cli/", "adapter/import_hook.py", "evaluation/lm_eval_tasks.py",
                        "pipeline/search_study.py")  # optuna: the search extra


def layer_of(package: str) -> int:
    for rank, members in enumerate(LAYERS):
        if package in members:
            return rank
    raise AssertionError(f"graftmerge/{package} is in no layer: add it to LAYERS and docs/architecture.md")


# A module with a layer of its own, below its package's: the one contact with mergekit's internals
# imports only mergekit and errors, and everything that needs one of those internals imports it.
OWN_LAYER = {"graftmerge.adapter.mergekit_compat": "mergekit_compat"}


def package_of(module: str) -> str:
    """``graftmerge.formats.checkpoint`` -> ``formats``; ``graftmerge`` -> ``""``."""
    if module in OWN_LAYER:
        return OWN_LAYER[module]
    parts = module.split(".")
    if parts[1:] == ["__main__"]:
        return "cli"
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def for_type_checkers(path: Path, tree: ast.Module) -> set[int]:
    """The imports under ``if TYPE_CHECKING:`` in graftmerge/__init__.py: they never run."""
    if path != PACKAGE / "__init__.py":
        return set()
    blocks = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    return {id(node) for block in blocks for node in ast.walk(block) if isinstance(node, ast.Import | ast.ImportFrom)}


def graftmerge_imports(path: Path) -> list[tuple[str, list[str], bool, int]]:
    """(imported module, imported names, at module top level, line) for every graftmerge import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    skipped = for_type_checkers(path, tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "graftmerge":
            found.append((node.module, [a.name for a in node.names], id(node) in top_level, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "graftmerge":
                    found.append((alias.name, [], id(node) in top_level, node.lineno))
    return found


def all_imports(path: Path) -> list[tuple[ast.stmt, bool]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level, skipped = {id(node) for node in tree.body}, for_type_checkers(path, tree)
    return [(n, id(n) in top_level) for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def resolve(module: str, name: str) -> str:
    """``from graftmerge.pipeline import graft_plan`` names a module; otherwise the module itself."""
    return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def edges() -> list[tuple[str, str, bool, int, list[str]]]:
    found = []
    for source, path in MODULES.items():
        for target, names, top, line in graftmerge_imports(path):
            targets = {resolve(target, n) for n in names} or {target}
            found += [(source, t, top, line, names) for t in targets]
    return found


def test_every_package_has_a_layer():
    for module in MODULES:
        layer_of(package_of(module))


def test_imports_point_down_the_layers():
    wrong = []
    for source, target, _, line, _ in edges():
        src, dst = package_of(source), package_of(target)
        if src == dst:
            continue
        if layer_of(dst) >= layer_of(src):
            wrong.append(
                f"{MODULES[source].relative_to(PACKAGE.parent)}:{line} imports {target} "
                f"({src or 'graftmerge'} -> {dst})"
            )
    assert not wrong, "upward or sideways imports:\n" + "\n".join(wrong)


def test_imports_sit_at_module_top_level():
    lazy = []
    for module, path in MODULES.items():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(LAZY_IMPORTS_ALLOWED) or module.endswith("__main__"):
            continue
        lazy += [f"{relative}:{node.lineno}" for node, top in all_imports(path) if not top]
    assert not lazy, "imports inside functions (move them to the top of the module):\n" + "\n".join(lazy)


def test_lazy_imports_say_why():
    """Where laziness is allowed, each function that imports lazily says so in a comment."""
    missing = []
    for path in MODULES.values():
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(LAZY_IMPORTS_ALLOWED):
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            lazy = [n for n in ast.walk(function) if isinstance(n, ast.Import | ast.ImportFrom)]
            if lazy and not any("lazy" in line.lower() for line in lines[function.lineno - 1 : lazy[0].lineno]):
                missing.append(f"{relative}:{function.lineno} {function.name}")
    assert not missing, "lazy imports without a '# lazy: ...' comment:\n" + "\n".join(missing)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for source, target, _, _, _ in edges():
        if target in MODULES and target != source:
            graph[source].add(target)
    # A package's __init__ is imported with each of its modules; it must not import them back.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module)


def test_no_private_names_from_other_packages():
    wrong = []
    for source, target, _, line, names in edges():
        if package_of(source) == package_of(target):
            continue
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        private += [part for part in target.split(".") if part.startswith("_") and part != "__main__"]
        if private:
            wrong.append(
                f"{MODULES[source].relative_to(PACKAGE.parent)}:{line} imports {', '.join(private)} from {target}"
            )
    assert not wrong, "private names used across packages:\n" + "\n".join(wrong)


MERGEKIT_INTERNALS = {"_execute", "_write_shard_task", "_copy_tokenizer", "_copy_tagalong_files", "_model_out_config",
                      "_METHODS"}  # what only adapter/mergekit_compat.py touches, with LoaderCache().loaders


def test_only_the_compat_module_touches_mergekit_internals():
    """No private mergekit name imported, overridden or called, and mergekit's loader cache not filled, anywhere but
    adapter/mergekit_compat.py (tests/test_mergekit_compat.py holds each against the pinned mergekit)."""
    wrong = []
    for module, path in MODULES.items():
        if module in OWN_LAYER:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mergekit":
                names = [a.name for a in node.names if a.name.startswith("_") or a.name in MERGEKIT_INTERNALS]
            elif (isinstance(node, ast.Attribute) and node.attr == "loaders"
                  and callee_name(node.value) == "LoaderCache"):
                names = ["LoaderCache().loaders"]
            elif isinstance(node, ast.FunctionDef | ast.Attribute | ast.Name):
                names = [n for n in [getattr(node, "name", None) or getattr(node, "attr", None)
                                     or getattr(node, "id", None)] if n in MERGEKIT_INTERNALS]
            else:
                continue
            wrong += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}" for name in names]
    assert not wrong, "mergekit internals outside adapter/mergekit_compat.py:\n" + "\n".join(wrong)


def test_the_graft_kernel_imports_only_math_and_formats():
    """One tensor's graft is the kernel's record and tensors in, math/ and formats/ called, the result out: it
    never asks the plan, the run or the config a question (pipeline/graft_kernel.py)."""
    kernel = "graftmerge.pipeline.graft_kernel"
    wrong = [target for source, target, *_ in edges() if source == kernel and package_of(target) not in (
        "math", "formats")]
    assert kernel in MODULES and not wrong, wrong


def test_no_flag_passes_through_the_environment():
    """The library reads the user's environment; it never writes into it to reach code further down."""
    wrong = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = node.value if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del) \
                else node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS else None
            if target is not None and ast.unparse(target) == "os.environ" or callee_name(node) == "putenv":
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not wrong, "os.environ written inside the library:\n" + "\n".join(wrong)


KERNELS = {"pipeline/graft.py", "pipeline/data_aware_merge.py", "methods/"}


def test_no_test_hook_in_a_kernel():
    """The per-tensor code calls no test hook: a test stops a merge through a callback its run was given."""
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for path in MODULES.values()
             if path.relative_to(PACKAGE).as_posix().startswith(tuple(KERNELS))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and callee_name(node) == "stage_reached"]
    assert not wrong, "stage_reached called in a kernel:\n" + "\n".join(wrong)


def public_definitions(tree: ast.Module):
    """Every non-underscore function and class, nested ones included (methods too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            yield node


def test_every_module_has_a_docstring():
    missing = [str(path.relative_to(PACKAGE.parent)) for path in MODULES.values()
               if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
    assert not missing, "modules without a docstring:\n" + "\n".join(missing)


def test_public_definitions_are_documented():
    total, missing = 0, []
    for path in MODULES.values():
        for node in public_definitions(ast.parse(path.read_text(encoding="utf-8"))):
            total += 1
            if not ast.get_docstring(node):
                missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    documented = 1 - len(missing) / total
    assert documented >= 0.95, f"{documented:.1%} of {total} public definitions documented:\n" + "\n".join(missing)


def test_functions_are_short():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_click_only_in_cli():
    """Only the command line knows click: below it, a refusal is a GraftError (cli/ says it in one line)."""
    wrong = []
    for module, path in MODULES.items():
        if package_of(module) == "cli":
            continue
        for node, _ in all_imports(path):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(name.split(".")[0] == "click" for name in names):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not wrong, "click imported outside graftmerge/cli/:\n" + "\n".join(wrong)


def test_graft_plan_is_built_in_one_place():
    """``GraftPlan(...)`` is called once in the package (``graft_plan.build_plan``); everything else derives plans
    from one with ``dataclasses.replace``."""
    calls = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "GraftPlan":
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("graftmerge/pipeline/graft_plan.py:"), calls


# Module-level stores that outlive a call, each with the reason it is not a merge's state.
# A merge's state lives in its MergeRun (pipeline/merge_run.py) and nowhere else.
PER_PROCESS = {
    "methods/graft.py:_ACTIVE_RUNS": "mergekit's per-tensor tasks carry only an id: a merge's run is "
                                     "findable by it while mergekit's run_merge runs, and removed after",
    "methods/data_aware.py:_ACTIVE_RUNS": "the same for fisher and regmean merges: a run findable by its "
                                          "id while its mergekit call runs, and removed after",
    "formats/output_folder.py:_ARRIVALS": "test hook: arrivals of this process at a stage, as the process's "
                                          "$GRAFTMERGE_TEST_STOP_AT counts them",
    "formats/user_cache.py:_warned": "each cache warning once per process",
    "formats/bounded_regex.py:_translated": "a pure function of a pattern, memoised",
    "formats/bounded_regex.py:_members": "a pure function of a regex node, memoised",
    "evaluation/lm_eval_tasks.py:task_manager": "the harness's index of task files for a folder set (11-25 s to "
                                                "build), not a merge's state",
    "math/projection.py:KFAC_ROTATIONS": "instrumentation: rotations done in this process, read by benchmarks "
                                         "and tests, never by a merge",
}
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakIdKeyDictionary",
              "WeakKeyDictionary", "WeakValueDictionary"}
MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
            "discard", "__setitem__"}


def callee_name(node: ast.expr) -> str | None:
    """``f`` of ``f``, ``m.f``, ``f(...)`` or ``m.f(...)``."""
    node = node.func if isinstance(node, ast.Call) else node
    return getattr(node, "id", getattr(node, "attr", None))


SELF_FILLING = {"ActiveRuns"}  # stores filled through their own methods (methods/active_runs.py): always stores


def module_stores(tree: ast.Module) -> set[str]:
    """Names of module-level containers the module writes into, and of its memoised (``lru_cache``) functions."""
    containers = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        made = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp) or (
            isinstance(value, ast.Call) and callee_name(value) in CONTAINERS)
        containers.update(t.id for t in targets if made and isinstance(t, ast.Name))
    written = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
               and isinstance(node.value, ast.Call) and callee_name(node.value) in SELF_FILLING
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    containers |= written
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            written.add(getattr(node.value, "id", None))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            written.add(getattr(node.func.value, "id", None))
    memoised = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and any(
        callee_name(decorator) in ("lru_cache", "cache") for decorator in node.decorator_list)}
    return (containers & written) | memoised


def test_no_module_level_store_of_a_merge():
    """No dict, set or list at module level that its module fills, and no memoised function, unless listed
    in PER_PROCESS with the reason it holds nothing of a merge (and every listed one still exists)."""
    found = {f"{path.relative_to(PACKAGE).as_posix()}:{name}"
             for path in MODULES.values() for name in module_stores(ast.parse(path.read_text(encoding="utf-8")))}
    assert found - set(PER_PROCESS) == set(), "module-level stores (a merge's state belongs in its MergeRun)"
    assert set(PER_PROCESS) - found == set(), "PER_PROCESS lists stores that are gone: remove them from the list"


TESTS = Path(__file__).resolve().parent


def imported_modules(node: ast.Import | ast.ImportFrom) -> list[tuple[str, bool]]:
    """(dotted name, relative) of every module an import statement may load, ``from X import Y`` giving X and X.Y."""
    if isinstance(node, ast.Import):
        return [(alias.name, False) for alias in node.names]
    base = node.module or ""
    return [(base, node.level > 0)] + [(f"{base}.{alias.name}".strip("."), node.level > 0) for alias in node.names]


def test_no_test_module_imports_another_or_conftest():
    """Each tests/test_*.py stands alone: shared code lives in tests/helpers/, fixtures in
    tests/conftest.py (which pytest loads itself, never imported as a module)."""
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        for node, _ in all_imports(path):
            for name, relative in imported_modules(node):
                parts = name.split(".")
                if parts[0] == "tests" and not relative:
                    parts = parts[1:]
                elif not relative and parts[0] not in {p.stem for p in TESTS.glob("*.py")}:
                    continue
                if parts and (parts[0].startswith("test_") or parts[0] == "conftest"):
                    wrong.append(f"{path.relative_to(TESTS.parent)}:{node.lineno} imports {name}")
                    break
    assert not wrong, "test modules importing test modules (move shared code to tests/helpers/):\n" + "\n".join(wrong)
