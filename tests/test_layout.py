"""The layout holds: the runtime (pipeline/ but for the tooling in pipeline/tools/) is a stack
of packages, each importing only from those below it; it imports neither the tooling nor the
training kit (tinykit/, a package of its own beside pipeline/); its modules import each other
without cycles; and it reads in short functions and modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"
# The runtime: pipeline/ but for the tooling, its packages (pipeline/config/) included.
RUNTIME = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "tools")
MAX_FUNCTION_LINES = 50
# The command line and the Python API are the runtime modules that dispatch to the tools.
DISPATCHERS = {"cli.py", "api.py"}
# The runtime's packages, bottom first: each imports only from itself and those before it.
# `fingerprint` is a module at the root because the training kit's recipe hashes it.
LAYERS = (
    "fingerprint",
    "config",
    "storage",
    "inputs",
    "commit",
    "cluster",
    "stages",
    "speculation",
    "graph",
    "job",
    "api",
    "cli",
)
MAX_MODULE_LINES = 400
MAX_ROOT_MODULES = 8


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def module_name(path: Path) -> str:
    """A runtime module's dotted name under pipeline/: "runner", "config.job", "config" (the package)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def test_the_runtime_imports_no_tooling_and_no_training_kit():
    offending = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith(("pipeline.tools", "tinykit")))
        for path in RUNTIME
        if path.name not in DISPATCHERS
    }
    assert len(RUNTIME) > 20
    assert {name: mods for name, mods in offending.items() if mods} == {}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_each_package_imports_only_from_those_below_it():
    assert {module_name(path).split(".")[0] for path in RUNTIME} - {"__init__"} == set(LAYERS)
    upward = sorted(
        f"{module_name(path)} imports pipeline.{used}"
        for path in RUNTIME
        if path.name not in DISPATCHERS and module_name(path) != "__init__"
        for used in (m[len("pipeline.") :] for m in imported_modules(path) if m.startswith("pipeline."))
        if used.split(".")[0] in LAYERS and layer(used) > layer(module_name(path))
    )
    assert upward == []


def test_the_root_holds_few_modules_and_no_module_is_long():
    """The runtime's modules and the tooling's (the kit's sources are pinned by its recipe hash)."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    tools = sorted((PACKAGE / "tools").glob("*.py"))
    assert len(tools) > 10
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in RUNTIME + tools
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_runtime_modules_import_each_other_without_cycles():
    """Imports inside functions count: a lazy import that closes a cycle still ties the two
    modules' definitions together, and hides which one owns a rule."""
    names = {module_name(path) for path in RUNTIME}
    graph = {
        module_name(path): {m[len("pipeline.") :] for m in imported_modules(path) if m.startswith("pipeline.")}
        & names - {module_name(path)}
        for path in RUNTIME
    }
    assert {"config", "config.job", "config.base"} <= names and "config.job" in graph["config"]
    assert sum(map(len, graph.values())) > 30  # the graph was read
    cycles, done = [], set()

    def walk(module: str, trail: list[str]) -> None:
        for used in sorted(graph[module]):
            if used in trail:
                cycles.append(" -> ".join(trail[trail.index(used) :] + [used]))
            elif used not in done:
                walk(used, trail + [used])
        done.add(module)

    for module in sorted(graph):
        walk(module, [module])
    assert cycles == []


def test_no_runtime_function_is_longer_than_fifty_lines():
    long = []
    for path in RUNTIME:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], "split these into steps that read top to bottom"


def test_the_kit_weights_are_not_inside_the_package():
    assert list((ROOT / "pipeline").rglob("*.safetensors")) == []
    assert list((ROOT / "models" / "tinykit").rglob("*.safetensors"))


def test_no_driver_function_takes_more_than_six_parameters():
    """The driver (pipeline/job/, the command line) passes objects (the plan, the attempt, the
    run's options), not their fields unpacked."""
    wide = []
    for path in RUNTIME:
        if module_name(path).split(".")[0] not in ("job", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
                if len([n for n in names if n not in ("self", "cls")]) > 6:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert wide == []


def ruff() -> str:
    import shutil

    found = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            "ruff not found beside this Python: the test extra installs it (`make test`, `pip install -e .[test]`)"
        )
    return found


def test_ruff_finds_nothing_the_project_holds():
    """`ruff check` with the project's rules (pyproject.toml: pyflakes and syntax errors), over
    every Python file: a name left behind by a rename fails here, not in a job."""
    found = subprocess.run(
        [ruff(), "check", "--no-cache", "--output-format", "concise", str(ROOT)], capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-1000:]


def test_every_python_file_is_as_the_formatter_writes_it():
    """`ruff format` (pyproject.toml: 120 columns) holds the layout; `ruff format .` rewrites
    the files this names."""
    checked = subprocess.run([ruff(), "format", "--check", "--no-cache", str(ROOT)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-1000:]


def test_the_formatter_check_finds_a_file_out_of_form(tmp_path: Path):
    (tmp_path / "m.py").write_text("x = {  'a':1 }\n")
    checked = subprocess.run([ruff(), "format", "--check", "--no-cache", str(tmp_path)], capture_output=True, text=True)
    assert checked.returncode == 1 and "m.py" in checked.stdout


# Where the driver and the engine actors meet: every parameter says what crosses.
TYPED_PACKAGES = ("job", "graph")


def untyped_parameters(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a)]
            found += [f"{node.name}({a.arg})" for a in every if a.annotation is None and a.arg not in ("self", "cls")]
    return found


def test_no_parameter_in_the_driver_and_engine_packages_is_untyped():
    untyped = {
        str(path.relative_to(PACKAGE)): names
        for path in RUNTIME
        if path.relative_to(PACKAGE).parts[0] in TYPED_PACKAGES and (names := untyped_parameters(path))
    }
    assert untyped == {}


def test_untyped_parameter_check_finds_one(tmp_path: Path):
    source = tmp_path / "m.py"
    source.write_text("def f(a: int, board, *rest, **options: int):\n    pass\n")
    assert untyped_parameters(source) == ["f(board)", "f(rest)"]


def module_level_code(path: Path) -> list[str]:
    """Statements of a module other than imports, `__all__` and its docstring, by line."""
    body = ast.parse(path.read_text()).body
    allowed = (ast.Import, ast.ImportFrom)
    found = []
    for i, node in enumerate(body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        exports = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        if not (isinstance(node, allowed) or docstring or exports):
            found.append(f"line {node.lineno}: {type(node).__name__}")
    return found


def test_package_inits_only_import_and_export():
    code = {
        str(path.relative_to(ROOT)): found
        for path in sorted([*PACKAGE.rglob("__init__.py"), ROOT / "schemas" / "__init__.py"])
        if (found := module_level_code(path))
    }
    assert code == {}, "move the code into a module named for it; the package re-exports it"


def test_module_level_code_check_finds_a_class(tmp_path: Path):
    init = tmp_path / "__init__.py"
    init.write_text('"""Doc."""\nfrom x import y\n__all__ = ["y"]\nclass Z:\n    pass\n')
    assert module_level_code(init) == ["line 4: ClassDef"]
