"""The shape of ``src/``: no import cycle (imports inside functions and under TYPE_CHECKING
count), the layers of docs/ARCHITECTURE.md, and the size limits of the request path and the
policies (functions, modules, parameters, cyclomatic complexity)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tidegate"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every tidegate module ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                yield target


GRAPH: dict[str, set[str]] = {name: set(_imports(name, path)) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(GRAPH[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_src_imports_itself_through_others() -> None:
    """No import cycle anywhere in src/, counting the imports hidden inside functions."""
    assert _cycles() == []


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("policy", {"policy", "clock", "errors"}),
        ("state", {"state", "policy", "clock", "errors", "ids", "timers"}),
    ],
)
def test_a_lower_layer_imports_only_what_is_below_it(layer: str, allowed: set[str]) -> None:
    """policy imports only the clock and the errors; state only the base layer of
    docs/ARCHITECTURE.md (clock, errors, ids, timers) and policy."""
    wrong = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _layer(name) == layer
        for target in targets
        if _layer(target) not in allowed
    }
    assert wrong == set()


def test_the_lab_and_the_gateway_never_import_each_other() -> None:
    wrong = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if {_layer(name), _layer(target)} == {"lab", "gateway"}
    }
    assert wrong == set()


# --------------------------------------------------------------------------- size limits

#: The request path and the policies read as small pieces: these are the limits (the lab's
#: engine has its own below).
MAX_FUNCTION_LINES = 80
MAX_COMPLEXITY = 15
MAX_PARAMETERS = 6
MAX_MODULE_LINES = 600
ENGINE_MAX_FUNCTION_LINES = 120
LIMITED = ("tidegate.gateway", "tidegate.policy")


def _complexity(function: ast.AST) -> int:
    """McCabe's cyclomatic complexity, counted as radon counts it: one, plus one per branch
    (if, elif, for, while, except, with-less boolean operands, comprehension ifs, match cases,
    conditional expressions, assert)."""
    score = 1
    for node in ast.walk(function):
        if node is not function and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
        ):
            continue
        if isinstance(
            node,
            ast.If
            | ast.For
            | ast.AsyncFor
            | ast.While
            | ast.IfExp
            | ast.ExceptHandler
            | ast.Assert,
        ):
            score += 1
        elif isinstance(node, ast.BoolOp):
            score += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            score += 1 + len(node.ifs)
        elif isinstance(node, ast.match_case):
            score += 1
    return score


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    names = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if names and names[0].arg in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _limited_modules() -> Iterator[tuple[str, Path]]:
    for name, path in MODULES.items():
        if name.startswith(LIMITED):
            yield name, path


def test_request_path_and_policy_functions_are_small() -> None:
    """In gateway/ and policy/: no function over 80 lines or above complexity 15, none with
    more than 6 parameters besides self."""
    problems = []
    for name, path in _limited_modules():
        for function in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{name}.{function.name} (line {function.lineno})"
            assert function.end_lineno is not None
            lines = function.end_lineno - function.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                problems.append(f"{where}: {lines} lines")
            if (complexity := _complexity(function)) > MAX_COMPLEXITY:
                problems.append(f"{where}: complexity {complexity}")
            if (count := _parameters(function)) > MAX_PARAMETERS:
                problems.append(f"{where}: {count} parameters")
    assert problems == []


def test_request_path_and_policy_modules_are_small() -> None:
    """In gateway/ and policy/: no module over 600 lines."""
    big = {
        name: lines
        for name, path in _limited_modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert big == {}


def test_the_lab_engine_has_no_function_over_120_lines() -> None:
    tree = ast.parse(MODULES["tidegate.lab.engine"].read_text(encoding="utf-8"))
    long = {
        f.name: f.end_lineno - f.lineno + 1
        for f in _functions(tree)
        if f.end_lineno is not None and f.end_lineno - f.lineno + 1 > ENGINE_MAX_FUNCTION_LINES
    }
    assert long == {}


def test_the_complexity_count_agrees_with_a_hand_count() -> None:
    """The counter is itself checked: a function with two ifs, a loop and an 'and' is 5."""
    source = "def f(a, b):\n    if a and b:\n        return 1\n    for x in a:\n        if x:\n            return x\n    return 0\n"
    (function,) = _functions(ast.parse(source))
    assert _complexity(function) == 5
