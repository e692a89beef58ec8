"""``pip install '.[engine]'`` into a clean virtual environment runs the CLI: every import
the engine and its CLI need is declared, and the LICENSE ships."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def test_clean_venv_with_the_engine_extra_runs_the_cli(tmp_path: Path) -> None:
    """A venv without system site-packages, the package installed from a copy of the source
    with ``[engine]`` (torch pinned to the running build, so pip takes the local wheel),
    serves 4 requests of the tiny model on CPU and exits 0."""
    src = tmp_path / "src"  # a copy: pip builds in place and must not write into the checkout
    shutil.copytree(ROOT / "hicache", src / "hicache", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    (tmp_path / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(tmp_path / "constraints.txt"), f"{src}[engine]"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    cli = [py, "-m", "hicache.engine", "--device", "cpu", "--model", "tiny", "--requests", "4"]
    cli += ["--prefix-tokens", "40", "--enable-hicache"]
    run = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "4 requests: 4 served, 0 failed" in run.stdout
    where = subprocess.run(
        [py, "-c", "import hicache, importlib.metadata as m; print(hicache.__file__); print(*m.files('hicache'))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    assert where.startswith(str(venv))  # the installed copy ran, not the checkout
    assert "LICENSE" in where


def _required_imports(path: Path) -> set[str]:
    """Top-level modules ``path`` imports outside ``try:`` blocks (those are optional)."""
    tree = ast.parse(path.read_text())
    optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"hicache"}


def test_every_module_the_package_imports_is_declared() -> None:
    """Each third-party module imported by hicache (outside ``hicache.testing``, which needs
    the dev tools) belongs to a distribution in ``dependencies`` or the ``engine`` extra."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower().replace("_", "-") for r in meta["dependencies"]}
    declared |= {Requirement(r).name.lower().replace("_", "-") for r in meta["optional-dependencies"]["engine"]}
    dists = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in sorted((ROOT / "hicache").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "hicache").parts:
            continue
        for module in _required_imports(path):
            names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            if not names & declared:
                undeclared[module] = str(path.relative_to(ROOT))
    assert undeclared == {}
