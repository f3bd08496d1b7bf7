"""The package's layers as folders (STYLE.md): every import, at module level or inside a function, points
down. core imports only torch and the standard library; no module imports a stage above its own, and the
stages beside each other (rm and diagnostics; ppo and sft) do not import each other."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tether"
# the shared layer: the top-level modules and the folders inputs/ (where inputs are read), rules/ (where rewards are
# called; both ranked as the top-level modules they were made of) and trl_compat/
SHARED = {"cli", "config", "presets", "checkpoint", "errors", "hf", "callbacks", "precision", "sharding", "tasks",
          "processes", "runlog", "export", "inputs", "rules", "hub", "cli_flags", "trl_compat", "watchdog"}
# rank of each room: a module may import rooms of a lower rank, and its own room
RANK = {"core": 0, "shared": 1, "rm": 2, "diagnostics": 2, "rollout": 3, "ppo": 4, "sft": 4, "demo": 5, "dpo": 5, "pipeline": 6, "top": 7}


def room_of(module: str) -> str:
    """``tether.ppo.step`` -> ``ppo``; ``tether.config`` -> ``shared``; ``tether`` / ``tether.cli`` -> ``top``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__", "cli"):
        return "top"
    return "shared" if parts[1] in SHARED else parts[1]


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out.append((name, path))
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the file, however deeply nested."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_every_module_has_a_room():
    rooms = {room_of(name) for name, _ in modules()}
    assert rooms <= set(RANK), rooms - set(RANK)
    assert {"core", "rm", "rollout", "ppo", "sft", "diagnostics", "demo", "shared"} <= rooms


@pytest.mark.parametrize("name, path", [m for m in modules() if room_of(m[0]) == "core"], ids=lambda x: str(x))
def test_core_imports_only_torch_and_the_standard_library(name, path):
    for line, module in imports(path):
        top = module.split(".")[0]
        ok = top == "torch" or top in sys.stdlib_module_names or module.startswith("tether.core")
        assert ok, f"{path.name}:{line} imports {module}"


@pytest.mark.parametrize("name, path", modules(), ids=lambda x: str(x))
def test_no_module_imports_a_room_above_or_beside_its_own(name, path):
    mine = room_of(name)
    for line, module in imports(path):
        if module != "tether" and not module.startswith("tether."):
            continue
        theirs = room_of(module)
        assert theirs == mine or RANK[theirs] < RANK[mine], \
            f"{path.relative_to(PACKAGE.parent)}:{line} ({mine}) imports {module} ({theirs})"


def test_every_room_says_what_it_may_import():
    for folder in ("core", "rm", "rollout", "ppo", "sft", "diagnostics", "demo", "inputs", "rules", "pipeline"):
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, folder
