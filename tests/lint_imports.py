"""Run import-linter over the package as it installs: `python -m tests.lint_imports [SRC]`.

The repository keeps the customer's layout (runtime/, actors/, messages/, ops/, kernels/) and
setuptools maps it to one package, `taipan` ([tool.setuptools.package-dir] in pyproject.toml).
import-linter walks a package's own directory, so it cannot see that mapping through an editable
install; this stages the mapped tree (a plain copy, as a wheel holds it) in a temporary directory
and runs `lint-imports` with the contracts of pyproject.toml ([tool.importlinter]) against it.
`make test` runs it; tests/test_layout.py shows that a back-edge fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path) -> dict[str, str]:
    """Import package -> source folder, from [tool.setuptools.package-dir]."""
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def stage(src: Path, dest: Path) -> Path:
    """Copy `src`'s folders into `dest` as the installed `taipan` tree; returns `dest`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # Parents first, so that taipan/ exists before taipan/actors/ lands inside it.
    for package, folder in sorted(package_dirs(src / "pyproject.toml").items()):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(src / folder, target, ignore=ignore, dirs_exist_ok=True)
    return dest


def run(src: Path = ROOT) -> subprocess.CompletedProcess:
    """lint-imports over a staged copy of `src`, with `src`'s pyproject.toml."""
    lint = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="taipan-lint-") as tmp:
        staged = stage(src, Path(tmp))
        # PYTHONPATH puts the staged copy ahead of the editable install's finder.
        env = dict(os.environ, PYTHONPATH=str(staged))
        cmd = [str(lint), "--config", str(src / "pyproject.toml"), "--no-cache", "--no-logo"]
        return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)


def main() -> int:
    done = run(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
