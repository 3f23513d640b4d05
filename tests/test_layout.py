"""The package's shape, checked: the layers a reader sees in the folder are the layers the imports
follow.

Each package has a rank; a module may import only modules of its own rank or below:

    0  envs, gc_freeze, kernels, scheduler       (no model, no engine)
    1  distributed                               (process groups, all-reduce)
    2  config, models, quantization, tokenizer, sampling  (a forward pass, a sampler, and
       EngineConfig, which checks names against the registries of quantization formats)
    3  worker                                    (executor, runner, CUDA graphs)
    4  engine, outputs, dp                       (Engine.step, LLM, AsyncLLM, the engine loop,
                                                 data-parallel engines behind a router)
    5  entrypoints, bench                        (CLI, HTTP server, benchmarks)

Imports inside `if TYPE_CHECKING:` are for type hints only and do not count. Every other import
counts, also one inside a function: a lazy import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinypaged"
RANK = {
    "envs": 0, "gc_freeze": 0, "kernels": 0, "scheduler": 0,
    "host": 0,
    "distributed": 1,
    "config": 2, "models": 2, "pooling": 2, "quantization": 2, "tokenizer": 2, "sampling": 2,
    "lora": 2,
    "worker": 3,
    "engine": 4, "outputs": 4, "dp": 4, "spec_decode": 4,
    "entrypoints": 5, "bench": 5, "__main__": 5, "__init__": 5,
}  # fmt: skip
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks below."""
    return ast.parse(path.read_text())


def imports(path: Path, modules: frozenset[str]) -> set[str]:
    """The tinypaged modules `path` imports, outside `if TYPE_CHECKING:` blocks. The packages
    above an imported module run too, but a package's __init__ is a docstring, so they are
    not counted."""
    tree = parsed(path)
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` or `from module import name`
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


@functools.cache
def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    names = frozenset(modules)
    return {name: imports(path, names) - {name} for name, path in modules.items()}


def rank(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


def test_every_package_has_a_rank():
    tops = {p.stem for p in PACKAGE.glob("*.py")}
    tops |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert tops <= set(RANK), f"give these a rank in RANK: {sorted(tops - set(RANK))}"


def test_no_import_reaches_up_a_layer():
    upward = [
        f"{a} (rank {rank(a)}) imports {b} (rank {rank(b)})"
        for a, targets in graph().items()
        for b in targets
        if rank(b) > rank(a)
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = graph()
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_top_level_stays_small():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_no_module_is_too_long_to_read_in_one_sitting():
    files = PACKAGE.rglob("*.py")
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    long = {path: n for path, n in lines.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_nothing_outside_tests_imports_tests():
    """Test helpers stay in tests/: the package, benchmarks, examples and docs stand alone."""
    offenders = []
    for folder in ("tinypaged", "benchmarks", "examples", "docs"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(parsed(path)):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and ast.unparse(node.func).startswith("sys.path")):
                    names = ["tests"] if "tests" in ast.unparse(node) else []
                if any(n.split(".")[0] in ("tests", "helpers") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"these reach into tests/: {offenders}"


def test_test_modules_share_through_helpers_only():
    """A test module imports no other test module: what tests share lives in tests/helpers."""
    offenders = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(parsed(path)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.split(".")[-1].startswith("test_"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
    assert not offenders, offenders
