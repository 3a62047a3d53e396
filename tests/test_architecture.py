"""The shape of src/ddplab: no import cycles, layers that import downwards. Module and function
sizes are a signal to look, not a rule: `make lint` reports them (scripts/sizes.py).

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
# Which layer may import which: a module imports only from its own group or from layers to its left.
# The root modules (config, errors, environment, entries, seeding and the package's own __init__)
# are the lowest; experiment.py is the user's contract; experiments/ (programs written against it)
# and tools/ (commands beside training) stand side by side and never import each other; launch/
# (with __main__) starts everything.
LAYERS = [["root"], ["distributed"], ["checkpoint"], ["train"], ["experiment"], ["experiments", "tools"], ["launch"]]
# "ddplab.tools.doctor:probe" or "ddplab/train/intervals.py": code named by a string is a dependency too
NAMED_IN_A_STRING = re.compile(r"\bddplab[./]([a-z_]+)")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ddplab modules that module `name` imports (a package's own __init__ excluded), and
    those whose package or module a string in it names."""
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {f"ddplab.{part}" for part in NAMED_IN_A_STRING.findall(node.value) if f"ddplab.{part}" in known}
    return {t for t in found if t != name and not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between modules, or None. Package __init__ files that only hold a
    docstring or re-export lazily are nodes like any other."""
    # 0 new, 1 on the path, 2 done
    state: dict[str, int] = defaultdict(int)
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state[w] == 1:
                return [*path[path.index(w) :], w]
            if state[w] == 0 and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if state[v] == 0 and (found := visit(v)):
            return found
    return None


def _group(module: str) -> str:
    """Every module's group: its package, or for a module at the package's root, root or experiment."""
    parts = module.split(".")
    if module == "ddplab.__main__":
        return "launch"
    if module == "ddplab.experiment":
        return "experiment"
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "root"


def _layer(module: str) -> int:
    group = _group(module)
    return next(level for level, groups in enumerate(LAYERS) if group in groups)


def _downwards_only(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a layer to the right, or of a sibling group on the same layer."""
    return [
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if _layer(t) > _layer(m) or (_layer(t) == _layer(m) and _group(t) != _group(m))
    ]


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    assert _cycle(_graph()) is None


def test_every_module_has_a_layer():
    assert {_group(m) for m in _modules()} == {group for groups in LAYERS for group in groups}
    assert _group("ddplab.console") == _group("ddplab.seeding") == "root"
    assert _layer("ddplab.experiments.bbbp") == _layer("ddplab.tools.doctor") < _layer("ddplab.launch.cli")


def test_modules_import_only_downwards():
    assert not _downwards_only(_graph())


@pytest.mark.parametrize(
    "module, source",
    [
        # a root module that reaches into the distributed package
        ("ddplab.console", "from .distributed import runtime"),
        # an example that imports the launcher
        ("ddplab.experiments.commands", "from ..launch.launcher import launch_function"),
        # a tool that runs an example's code, named by a string
        ("ddplab.tools.doctor", "PROBE = 'ddplab.experiments.commbench:doctor_probe'"),
        # a lower layer that names a file of a higher one
        ("ddplab.distributed.hangs", "HEARTBEAT = os.path.join('x') or 'ddplab/train/intervals.py'"),
    ],
)
def test_the_layering_check_finds_each_kind_of_tangle(tmp_path, module, source):
    """Each of these once stood in the code; planted back, the check names it."""
    path = tmp_path / "planted.py"
    path.write_text(source + "\n")
    graph = _graph()
    graph[module] = _imports(module, path, set(_modules()) | {"ddplab.experiments.commbench"})
    assert any(line.startswith(f"{module} imports") for line in _downwards_only(graph))


LIBRARY = sorted(PACKAGE.rglob("*.py"))


def test_every_package_says_what_lives_there():
    for init in PACKAGE.glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), init


ENV_NAME = re.compile(
    r"^(DDPLAB|TORCHELASTIC|TORCH|GLOO|OMP|NCCL|CUDA|SLURM|OMPI|PMI|MPI|SM|MASTER|WORLD|LOCAL|GROUP|"
    r"NODE)_[A-Z0-9_]+$|^RANK$"
)
ENV_OWNERS = {PACKAGE / "environment.py", PACKAGE / "distributed" / "cluster.py"}


def test_environment_variables_are_named_in_one_place():
    """environment.py names every variable ddplab reads or writes; the launcher variables of
    schedulers are read by cluster.py alone."""
    stray = [
        f"{p.relative_to(PACKAGE)}: {node.value}"
        for p in LIBRARY
        if p not in ENV_OWNERS
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value)
    ]
    assert not stray
