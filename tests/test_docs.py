"""The documentation site (docs/, mkdocs.yml): the generated configuration reference matches the code, the site
builds with `mkdocs build --strict`, every page is in the nav and every nav entry exists, and the README (and
its links) keeps the commands CI runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import production_mesh_default
from tests.require import require_module

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATOR = ROOT / "tools" / "gen_config_docs.py"

# the README's commands that .ci/run executes (stage 1 and 3: the first two; stage 2: the third's pytest)
CI_COMMANDS = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m tx.run",
    ". .venv/bin/activate && python examples/tinker_client.py",
    'bash .ci/run        # = fresh .venv, pip install torch==2.13.0 -e ".[dev]", python -m pytest -q tests',
]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    raise TypeError(f"mkdocs.yml nav: unexpected entry {node!r}")


def test_config_reference_is_current():
    gen = _generator()
    # the pages document what users get: the production mesh default, not the one-device default that
    # tests/conftest.py pins for this process
    with production_mesh_default():
        problems = gen.stale()
    assert not problems, ("\n".join(problems) + f"\n\nThe configuration reference (docs/reference/) is stale; "
                          f"regenerate it with: {gen.COMMAND}")


def test_generator_output_is_deterministic():
    gen = _generator()
    with production_mesh_default():
        first, second = gen.render_all(), gen.render_all()
    assert first == second
    home = os.path.expanduser("~").rstrip("/") + "/"
    for name, text in first.items():
        assert not re.search(r" at 0x[0-9a-f]+", text) and home not in text, f"{name}: machine-specific text"


def test_site_builds_strict(tmp_path):
    require_module("mkdocs")
    require_module("material")  # mkdocs-material, the theme
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "reference" / "backend" / "index.html").exists()


def test_every_page_is_in_the_nav():
    config = _mkdocs_config()
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), f"mkdocs.yml nav lists a page twice: {sorted(nav)}"
    missing = sorted(f for f in nav if not (DOCS / f).is_file())
    assert not missing, f"mkdocs.yml nav names pages that do not exist under docs/: {missing}"
    excluded = {line.strip().lstrip("/") for line in (config.get("exclude_docs") or "").splitlines() if line.strip()}
    assert not any(set(p) & set("*?[!") for p in excluded), "exclude_docs: name files, not patterns (this test)"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - excluded
    assert not pages - set(nav), f"pages under docs/ missing from mkdocs.yml's nav: {sorted(pages - set(nav))}"


def test_readme_keeps_the_ci_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    for command in CI_COMMANDS:
        assert command in lines, f"README.md lost the command CI runs (.ci/run), word for word: {command}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-m tx.run --port" in ci and "examples/tinker_client.py" in ci and "python -m pytest -q tests" in ci


def test_readme_links_resolve():
    """README.md's links are relative to the repository root (the site does not build it): check them here."""
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "no links found"
    broken = sorted({link for link in local if link and not (ROOT / link).exists()})
    assert not broken, f"README.md links to missing files: {broken}"
