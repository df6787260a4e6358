"""The repository's rooms hold: no role imports another, lower floors never import upward, cited paths exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "pipeline", "storage", "infra")
ROLES = ("actors.trainer", "actors.generator")
CITED_PATH = re.compile(r"`((?:actors|pipeline|storage|infra|configs|tests|docs)/[A-Za-z0-9_./-]*)`")
"""A repository path in backticks, as docstrings and Markdown cite files and folders."""


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (function-local ones included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_role_imports_another_role() -> None:
    offenders = []
    for module, path in _modules().items():
        own = next((role for role in ROLES if _within(module, role)), None)
        if own is None:
            continue
        for imported in _imports(path):
            for other in ROLES:
                if other != own and _within(imported, other):
                    offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not offenders, "\n".join(sorted(set(offenders)))


@pytest.mark.parametrize("package", ["pipeline", "storage", "infra"])
def test_lower_floors_never_import_actors(package: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {imported}"
        for module, path in _modules().items()
        if _within(module, package)
        for imported in _imports(path)
        if _within(imported, "actors")
    ]
    assert not offenders, "\n".join(offenders)


def test_storage_does_not_know_the_config_or_the_pipeline() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {imported}"
        for module, path in _modules().items()
        if _within(module, "storage")
        for imported in _imports(path)
        if _within(imported, "pipeline")
    ]
    assert not offenders, "\n".join(offenders)


def test_every_path_cited_in_docs_and_docstrings_exists() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [path for package in (*PACKAGES, "tests") for path in sorted((ROOT / package).rglob("*.py"))]
    missing = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for cited in CITED_PATH.findall(line):
                if "<" in cited or "*" in cited:
                    continue  # a pattern such as `tests/test_*.py`, not a path
                if not (ROOT / cited.rstrip("/")).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_the_design_document_is_in_the_repository_and_nothing_cites_the_old_one() -> None:
    assert (ROOT / "docs" / "design.md").is_file()
    old = [
        f"{path.relative_to(ROOT)}"
        for package in (*PACKAGES, "tests", "configs")
        for path in (ROOT / package).rglob("*")
        if path.is_file()
        and path.suffix in {".py", ".yaml", ".md"}
        and re.search(r"(?<!docs/)DESIGN\.md", path.read_text())
    ]
    assert not old, f"cite docs/design.md instead of the old out-of-repo design file in: {old}"


FLOORS = ("pipeline.rl", "pipeline.tasks", "pipeline.sandbox", "pipeline.chat", "pipeline.wire")
"""`pipeline/` from the top down: the RL logic, then tasks, then sandboxes, then chat rendering, then the wire; a floor
imports only those below it."""
ACTOR_FLOORS = (
    ("actors.cli",),
    ("actors.sft",),
    ("actors.tools",),
    ("actors.trainer", "actors.generator"),
    ("actors.launcher", "actors.fleet", "actors.model_files"),
    ("actors.models", "actors.servers", "actors.cli_args", "actors.moe"),
)
"""`actors/` from the top down: the command, SFT, the tools, the two roles, what starts and places roles (and the
model files they share), what every process needs (the model, its servers, the commands' shared arguments). A room imports only rooms on lower floors
(and `pipeline/`, `storage/`, `infra/`, all below `actors/`); rooms on one floor never import each other."""
MAX_FILE_LINES = 600


@pytest.mark.parametrize("upper", range(len(FLOORS)))
def test_pipeline_floors_import_only_downward(upper: int) -> None:
    above = FLOORS[:upper]
    offenders = [
        f"{path.relative_to(ROOT)} imports {imported}"
        for module, path in _modules().items()
        if _within(module, FLOORS[upper])
        for imported in _imports(path)
        if any(_within(imported, floor) for floor in above)
    ]
    assert not offenders, "\n".join(offenders)


def _actor_floor(module: str) -> int | None:
    return next((i for i, floor in enumerate(ACTOR_FLOORS) for room in floor if _within(module, room)), None)


def test_every_actors_room_sits_on_a_floor() -> None:
    rooms = {".".join(module.split(".")[:2]) for module in _modules() if module.startswith("actors.")}
    assert not {room for room in rooms if _actor_floor(room) is None}, "add the room to ACTOR_FLOORS"


def test_actors_floors_import_only_downward() -> None:
    offenders = []
    for module, path in _modules().items():
        floor = _actor_floor(module)
        if floor is None:
            continue
        room = next(r for r in ACTOR_FLOORS[floor] if _within(module, r))
        for imported in _imports(path):
            target = _actor_floor(imported)
            if target is not None and target <= floor and not _within(imported, room):
                offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not offenders, "\n".join(sorted(set(offenders)))


def test_the_failure_taxonomy_imports_nothing_of_the_project() -> None:
    """`pipeline/failures.py` sits under every floor (sandboxes and the wire import it)."""
    imported = _imports(ROOT / "pipeline" / "failures.py")
    assert not [name for name in imported if name.split(".")[0] in PACKAGES]


def _design_layout_paths() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("### Repository layout", 1)[1].split("\n\n", 2)[1]
    return {path.rstrip("/") for row in table.splitlines() for path in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_every_package_has_a_row_in_the_design_layout_map() -> None:
    """design.md's layout table is the one map of the tree (the README links to it): every package has its row."""
    packages = {str(p.parent.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    missing = sorted(packages - _design_layout_paths())
    assert not missing, f"packages without a row in docs/design.md's layout table: {missing}"


def test_the_wire_does_not_know_the_config() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {imported}"
        for module, path in _modules().items()
        if _within(module, "pipeline.wire")
        for imported in _imports(path)
        if _within(imported, "pipeline.config")
    ]
    assert not offenders, "\n".join(offenders)


def _module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports: `from package import submodule` names the submodule, not the package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(node.module)
    return names & modules.keys()


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _module_imports(path, modules) - {module} for module, path in modules.items()}


def test_no_import_circle() -> None:
    """No module imports one that imports it back, at any distance (lazy and TYPE_CHECKING imports included)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_file_over_the_size_limit() -> None:
    files = [path for package in (*PACKAGES, "tests") for path in (ROOT / package).rglob("*.py")]
    big = [f"{p.relative_to(ROOT)}: {n}" for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, f"files over {MAX_FILE_LINES} lines (split them by concept):\n" + "\n".join(big)


MAX_FUNCTION_LINES = 100
"""A function longer than this holds several steps: name each one."""


def test_no_function_over_the_size_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines"
        for module, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in `tests/support/`; a test module is never a library for another."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name in _imports(path):
            leaf = name.split(".")[-1]
            if leaf.startswith("test_") or ".test_" in name:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_a_private_name_of_another() -> None:
    """A name with a leading underscore is its module's own: a caller that needs it needs a public API."""
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != module:
                if node.module.split(".")[0] in PACKAGES:
                    offenders += [
                        f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                    ]
    assert not offenders, "\n".join(offenders)


PRIVATE_IMPORTS_IN_TESTS = {
    "tests/trainer/test_packing.py": {"actors.trainer.backends.fused._contain_module_patch"},
}
"""Tests that reach a private name, and which: each is a seam the source does not offer yet. Keep this list short."""


def test_no_test_imports_a_private_name_beyond_its_allowance() -> None:
    """Tests drive the code through its public API and its seams; a fault injected through a private name breaks
    silently when the name moves."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        allowed = PRIVATE_IMPORTS_IN_TESTS.get(str(path.relative_to(ROOT)), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                offenders += [
                    f"{path.relative_to(ROOT)} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and f"{node.module}.{a.name}" not in allowed
                ]
    assert not offenders, "\n".join(offenders)
