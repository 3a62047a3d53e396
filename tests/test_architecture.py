"""The shape of src/ddplab: no import cycles, short modules and functions, packages that layer.

Read from the source with `ast`, imports inside functions included: a lazy import is still a
dependency a reader has to follow.
"""

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ddplab"
# Which package may import which: a package never imports one to its right.
LAYERS = ["distributed", "checkpoint", "train", "experiment", "tools", "launch"]
# the core (src/ddplab without experiments/) stays under 4,000 non-blank lines: new checks must earn their lines
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CORE_LINES = 400, 60, 4000


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ddplab modules that module `name` imports (a package's own __init__ excluded)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found |= {t for t in [target] + [f"{target}.{a.name}" for a in node.names] if t in known}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return {t for t in found if t != name and not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between modules, or None. Package __init__ files that only hold a
    docstring or re-export lazily are nodes like any other."""
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v], _ = 1, path.append(v)
        for w in sorted(graph.get(v, ())):
            if state[w] == 1:
                return path[path.index(w):] + [w]
            if state[w] == 0 and (found := visit(w)):
                return found
        state[v], _ = 2, path.pop()
        return None

    for v in sorted(graph):
        if state[v] == 0 and (found := visit(v)):
            return found
    return None


def _layer(module: str) -> int | None:
    part = module.split(".")[1] if module.count(".") else None
    return LAYERS.index(part) if part in LAYERS else None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    assert _cycle(_graph()) is None


def test_packages_import_only_downwards():
    wrong = [f"{m} imports {t}" for m, targets in _graph().items() for t in targets
             if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert not wrong


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "experiments" not in p.parts)  # examples are not measured


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_length(path):
    text = path.read_text()
    assert sum(1 for line in text.splitlines() if line.strip()) <= MAX_MODULE_LINES
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_the_library_stays_small():
    core = sum(sum(1 for line in p.read_text().splitlines() if line.strip()) for p in LIBRARY)
    assert core <= MAX_CORE_LINES


def test_every_package_says_what_lives_there():
    for init in PACKAGE.glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), init


ENV_NAME = re.compile(r"^(DDPLAB|TORCHELASTIC|TORCH|GLOO|OMP|NCCL|CUDA|SLURM|OMPI|PMI|MPI|SM|MASTER|WORLD|LOCAL|GROUP|"
                      r"NODE)_[A-Z0-9_]+$|^RANK$")
ENV_OWNERS = {PACKAGE / "environment.py", PACKAGE / "distributed" / "cluster.py"}


def test_environment_variables_are_named_in_one_place():
    """environment.py names every variable ddplab reads or writes; the launcher variables of
    schedulers are read by cluster.py alone."""
    stray = [f"{p.relative_to(PACKAGE)}: {node.value}" for p in LIBRARY if p not in ENV_OWNERS
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value)]
    assert not stray
