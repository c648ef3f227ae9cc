"""ARCHITECTURE.md's import rules: light packages stay torch-free, process packages stay apart."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = [
    "frontend",
    "orchestrator",
    "context_worker",
    "generation_worker",
    "postproc_worker",
]
TORCH_FREE = ["common", "frontend", "launcher", "orchestrator", "postproc_worker"]
HEAVY = {"torch", "triton", "nixl", "nixl_cu12", "nixl_cu13", "transformers", "engine", "tools"}


def imported_roots(package: str) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in the package, per file."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        roots: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = roots
    return found


@pytest.mark.parametrize("package", PROCESS_PACKAGES)
def test_process_packages_do_not_import_each_other(package: str) -> None:
    others = set(PROCESS_PACKAGES) - {package}
    for path, roots in imported_roots(package).items():
        assert not roots & others, f"{path} imports {roots & others}"


@pytest.mark.parametrize("package", TORCH_FREE)
def test_light_packages_never_import_torch_or_engine(package: str) -> None:
    for path, roots in imported_roots(package).items():
        assert not roots & HEAVY, f"{path} imports {roots & HEAVY}"


def test_common_imports_only_itself_among_project_packages() -> None:
    for path, roots in imported_roots("common").items():
        assert not roots & set(PROCESS_PACKAGES), f"{path} imports {roots & set(PROCESS_PACKAGES)}"


def test_the_launcher_starts_processes_without_importing_them() -> None:
    """It reaches the orchestrator only over the protocol, and starts every process by name."""
    for path, roots in imported_roots("launcher").items():
        assert not roots & set(PROCESS_PACKAGES), f"{path} imports {roots & set(PROCESS_PACKAGES)}"


@pytest.mark.parametrize("package", TORCH_FREE)
def test_importing_light_packages_loads_no_torch(package: str) -> None:
    modules = [
        f"{package}.{p.stem}" if p.stem != "__init__" else package
        for p in sorted((ROOT / package).glob("*.py"))
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
