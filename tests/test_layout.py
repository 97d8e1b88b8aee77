"""DESIGN's layout rules, read from the code: the root is the core and imports no folder (imports
inside functions and `__main__` blocks count), the root's imports point down with no circle, and
`import grpo` loads root modules only."""

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = sorted(p.stem for p in REPO.glob("*.py"))
FOLDERS = sorted(
    p.name
    for p in REPO.iterdir()
    if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))
)


def imported(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, wherever the import statement sits."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_root_module_imports_a_folder():
    assert {"dialogue", "reward_models", "prepare", "tools", "integrations"} <= set(FOLDERS)
    found = {
        module: sorted(imported(REPO / f"{module}.py") & set(FOLDERS))
        for module in ROOT
        if imported(REPO / f"{module}.py") & set(FOLDERS)
    }
    assert found == {}


def test_the_root_imports_point_down_with_no_circle():
    graph = {m: sorted(imported(REPO / f"{m}.py") & set(ROOT) - {m}) for m in ROOT}
    state: dict[str, str] = {}

    def visit(module, path):
        if state.get(module) == "open":
            raise AssertionError("import circle: " + " -> ".join([*path, module]))
        if state.get(module) == "done":
            return
        state[module] = "open"
        for child in graph[module]:
            visit(child, [*path, module])
        state[module] = "done"

    for module in ROOT:
        visit(module, [])


def test_import_grpo_loads_root_modules_only():
    probe = (
        "import json, sys; from pathlib import Path; import grpo; "
        f"repo = Path({str(REPO)!r}); "
        "print(json.dumps(sorted(str(Path(m.__file__).resolve().relative_to(repo)) "
        "for m in list(sys.modules.values()) if getattr(m, '__file__', None) "
        "and Path(m.__file__).resolve().is_relative_to(repo) and Path(m.__file__).is_file())))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "grpo.py" in loaded and "rollout.py" in loaded
    assert [p for p in loaded if "/" in p] == []
