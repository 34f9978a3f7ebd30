"""The package's layering: no import cycle, the kernels never import the layers above them, and the command-line
tooling (`flashtriton.tools`) is imported by the command alone."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "flashtriton"
KERNELS_MAY_IMPORT = {"flashtriton._env", "flashtriton.configs"}  # besides flashtriton.kernels.*
TOOLS = "flashtriton.tools"
TOOLS_IMPORTED_BY = {"flashtriton.cli"}  # besides flashtriton.tools.*


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """flashtriton modules `path` imports, anywhere in the file (lazy imports inside functions count)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("flashtriton"):
                if node.module:  # `from .x import y`: module x (and y, if y is a module)
                    found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from . import x`: module x
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flashtriton"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {t for t in _imports(path) if t in modules and t != name} for name, path in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_kernels_import_only_kernels_configs_and_env():
    for name, targets in _graph().items():
        if name.startswith("flashtriton.kernels"):
            upward = {t for t in targets if not t.startswith("flashtriton.kernels") and t not in KERNELS_MAY_IMPORT}
            assert not upward, f"{name} imports {sorted(upward)} (a layer above the kernels)"


def test_tools_subpackage_holds_the_tooling():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for name in ("bench", "bench_core", "bench_measure", "bench_providers", "bench_suites", "bench_report", "checks",
                 "tune"):
        assert f"{TOOLS}.{name}" in modules, f"{TOOLS}.{name} missing"
        assert f"flashtriton.{name}" not in modules, f"flashtriton.{name} belongs in {TOOLS}"


def test_only_the_command_imports_the_tools():
    for name, targets in _graph().items():
        if name == TOOLS or name.startswith(TOOLS + ".") or name in TOOLS_IMPORTED_BY:
            continue
        tools = {t for t in targets if t == TOOLS or t.startswith(TOOLS + ".")}
        assert not tools, f"{name} imports {sorted(tools)} (the command-line tooling; only the command may)"
