"""The commands the docs give run what they name: every `python X.py`, `python -m pkg.mod` and
`torchrun ... X.py | -m pkg.mod` in README.md, docs/, the configs' comments and the scripts'
docstrings names a script or module of this repository, and every repository file a doc links to
exists (a file that moved would otherwise leave a command that fails)."""

import re
from pathlib import Path

import pytest
from helpers import DOC_PAGES as DOCS
from helpers import documented_config_commands, load_documented_config

REPO = Path(__file__).resolve().parents[1]
# `python X.py`, `python -m a.b`, `torchrun [options] X.py` / `torchrun [options] -m a.b`
COMMAND = re.compile(
    r"(?:\bpython3?|\btorchrun(?:\s+--?[\w-]+(?:[ =](?!-m\b)[^\s-][^\s]*)?)*)\s+"
    r"(?:-m\s+(?P<module>[A-Za-z_][\w.]*)|(?P<script>[\w/.-]+\.py)\b)"
)
OUTSIDE = {
    "pytest",
    "pip",
    "venv",
    "vllm.entrypoints.openai.api_server",
    "torch.distributed.run",
    "verl.trainer.main_ppo",
}
PLACEHOLDERS = {"folder.X", "folder.script"}  # how a docstring names the pattern


def targets(text: str):
    for match in COMMAND.finditer(text):
        if match.group("module"):
            yield "module", match.group("module")
        else:
            yield "script", match.group("script")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_names_a_script_or_module_that_exists(path):
    text = path.read_text(encoding="utf-8")
    missing = []
    for kind, name in targets(text):
        if kind == "module":
            if name.split(".")[0] in OUTSIDE or name in OUTSIDE | PLACEHOLDERS:
                continue
            parts = name.split(".")
            found = (REPO / Path(*parts)).with_suffix(".py").is_file() or (
                REPO / Path(*parts) / "__init__.py"
            ).is_file()
        elif "/" in name and not name.startswith("bench/"):
            found = False  # a folder's script runs as a module: `python -m folder.script`
        else:
            found = (REPO / name).is_file() or name.startswith(("path/", "X.py", "script"))
        if not found:
            missing.append(f"{kind} {name}")
    assert not missing, f"{path.relative_to(REPO)}: {sorted(set(missing))}"


def test_every_markdown_link_to_a_file_of_the_repository_exists():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_every_documented_config_loads_against_the_schema_of_the_script_it_is_given_to():
    """A config given to the wrong entry point (a dialogue config to grpo.py) stops at its first
    key, and so does an override the script has no key for: each documented command's config is
    loaded here as its script loads it, with the command's overrides."""
    from config import ConfigError

    wrong, checked = [], 0
    for page, script, config, overrides in documented_config_commands():
        try:
            load_documented_config(script, config, overrides)
            checked += 1
        except ConfigError as e:
            wrong.append(f"{page.relative_to(REPO)}: {script} {config}: {e}")
    assert checked > 20 and not wrong, wrong
