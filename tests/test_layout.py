"""The package's layout: every module on a floor of the layers contract, none importing upwards
or in a circle, none over ~600 lines without saying why (docs/layout.md)."""

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lopd"


def floors() -> list[list[str]]:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contract["contracts"] if c["type"] == "layers")["layers"]
    return [[name.strip() for name in floor.split("|")] for floor in layers]


def test_every_module_of_the_package_is_on_a_floor():
    placed = [name for floor in floors() for name in floor]
    modules = sorted(p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
                     if (p.suffix == ".py" and p.stem != "__init__")
                     or (p.is_dir() and (p / "__init__.py").exists()))
    assert sorted(placed) == modules, "add the module to the layers in pyproject.toml"


def _imports(path: Path) -> set[str]:
    """The lopd modules a file imports, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lopd":
                found |= {f"lopd.{a.name}" for a in node.names}
            elif node.module.startswith("lopd."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lopd.")}
    return found


def test_no_module_imports_from_a_floor_above_its_own():
    # The same rule as import-linter's contract, read off the source: a test that fails on its
    # own, whether or not `make lint` ran.
    floor_of = {name: i for i, floor in enumerate(floors()) for name in floor}
    upward = []
    for path in PACKAGE.rglob("*.py"):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top == "__init__":
            continue
        for target in _imports(path):
            other = target.split(".")[1]
            if other != top and other in floor_of and floor_of[other] < floor_of[top]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not upward, upward


def test_long_modules_say_why_they_are_one_piece():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > 620 and "One piece" not in doc:
            long.append(f"{path.relative_to(PACKAGE)} ({lines} lines)")
    assert not long, long


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
                    reason="import-linter is installed by `make` (the lint extra)")
def test_the_layers_contract_is_kept():
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]
