"""The package as users install it: one import package `taipan`, layers without back-edges.

The wheel is built once per session from a copy of the source folders (so no build output lands
in the repository) and without network (`--no-build-isolation`: setuptools is in the venv).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import lint_imports

ROOT = lint_imports.ROOT
FOLDERS = ("runtime", "actors", "messages", "ops", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in (*FOLDERS, "pyproject.toml", "README.md"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run([*cmd, "-w", str(out), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [whl] = out.glob("taipan_llm-*.whl")
    return whl


def test_the_wheel_holds_one_import_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"taipan"}
    for module in (
        "taipan/__init__.py",
        "taipan/cli.py",
        "taipan/server/app.py",
        "taipan/bench/command.py",
        "taipan/ops/hf_bench.py",
        "taipan/actors/base.py",
        "taipan/actors/engine/scheduler.py",
        "taipan/messages/codec.py",
        "taipan/ops/models/llama.py",
        "taipan/kernels/__init__.py",
    ):
        assert module in names
    with zipfile.ZipFile(wheel) as zf:
        [entry] = [n for n in names if n.endswith("entry_points.txt")]
        assert "taipan = taipan.cli:main" in zf.read(entry).decode()


def test_the_public_api_imports_from_taipan_without_torch():
    code = (
        "import sys\n"
        "from taipan import AsyncClient, Client, SamplingParams\n"
        "assert 'torch' not in sys.modules, 'the client side imported torch'\n"
        "print(Client.__module__, AsyncClient.__module__, SamplingParams.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["taipan.client", "taipan.client", "taipan.messages.requests"]


def _old_name_imports(path: Path) -> list[str]:
    """Imports of the folders' own names (`runtime`, `actors`, ...) instead of `taipan.…`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return found


def test_every_import_uses_the_taipan_namespace():
    files = [p for folder in (*FOLDERS, "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 50
    assert [hit for p in files for hit in _old_name_imports(p)] == []


def test_the_layer_contracts_hold():
    done = lint_imports.run()
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    "where, source, contract",
    [
        # actors never import runtime (here: a function-level import, which counts too)
        (
            "actors/engine/back_edge.py",
            "def f():\n    from taipan.launcher import Runtime\n    return Runtime\n",
            "runtime (taipan.*) > actors",
        ),
        # actor subpackages never import each other
        (
            "actors/engine/back_edge.py",
            "from taipan.actors.coordinator.fsm import State\n",
            "actor subpackages never import each other",
        ),
        # messages import nothing of ours
        ("messages/back_edge.py", "import taipan.ops.sampling\n", "> messages"),
        # the bench's workload families never import each other
        ("runtime/bench/offline.py", "from taipan.bench.decode import ours_modes\n", "bench's"),
    ],
)
def test_a_back_edge_breaks_the_contracts(tmp_path, where, source, contract):
    for name in (*FOLDERS, "pyproject.toml"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, tmp_path / name)
    (tmp_path / where).write_text(source)
    done = lint_imports.run(tmp_path)
    assert done.returncode != 0
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), done.stdout[-3000:]
