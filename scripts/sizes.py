"""The sizes of src/ddplab's modules and functions: a signal to look, never a failure.

A module past ~400 non-blank lines may hold two concerns, a function past 60 lines may do more than
one thing; either may also be one idea that reads best whole (never split an idea to fit a number).
`make lint` prints this after the style checks; the import rules (layers, no cycles) are
tests/test_architecture.py's and do fail.

    python scripts/sizes.py          # what is past the signals, largest first
    python scripts/sizes.py --all    # every module"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddplab"
MODULE_LINES, FUNCTION_LINES = 400, 60


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(non-blank lines, module) for every module; (lines, module:function) for every function."""
    modules, functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE))
        modules.append((sum(1 for line in text.splitlines() if line.strip()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(modules, reverse=True), sorted(functions, reverse=True)


def main(show_all: bool) -> None:
    modules, functions = sizes()
    past = [(n, m) for n, m in modules if n > MODULE_LINES]
    shown = modules if show_all else past
    print(
        f"sizes: {len(modules)} modules, {len(past)} past {MODULE_LINES} non-blank lines; "
        f"{len(functions)} functions, median {functions[len(functions) // 2][0]} lines, "
        f"{sum(n > FUNCTION_LINES for n, _ in functions)} past {FUNCTION_LINES}"
    )
    for n, name in shown:
        print(f"  {n:5d}  {name}")
    for n, name in functions:
        if n > FUNCTION_LINES:
            print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main("--all" in sys.argv)
