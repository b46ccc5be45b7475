"""The repository root is safe to run Python from.

`python -m` and `python -c` put the current directory first on sys.path, so
a top-level folder that is a regular package (has an `__init__.py`) would
shadow a standard-library module of the same name: `operator/` used to hide
the stdlib `operator` from every tool started at the root. The folders are
namespace portions now, which never win over a regular module later on the
path; `pdcluster.runtime` and `pdcluster.operator` are still importable.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter that knows nothing of the project (no pip, no packages)."""
    env_dir = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    return str(env_dir / "bin" / "python")


def _run(python: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(params=["bare", "project"])
def python(request: pytest.FixtureRequest, bare_python: str) -> str:
    return bare_python if request.param == "bare" else sys.executable


def test_import_operator_is_the_standard_library(python: str) -> None:
    done = _run(python, "-c", "import operator; print(operator.eq)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "<built-in function eq>"


def test_python_m_json_tool_runs_from_the_root(python: str) -> None:
    done = _run(python, "-m", "json.tool", stdin='{"a": [1]}')
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["{", '"a":', "[", "1", "]", "}"]


def test_the_project_packages_import_in_the_project_venv() -> None:
    done = _run(
        sys.executable,
        "-c",
        "import pdcluster.operator, pdcluster.runtime.spec, pdcluster.runtime.router.app;"
        " print(pdcluster.runtime.spec.__name__)",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pdcluster.runtime.spec"


def test_no_top_level_folder_is_a_regular_package() -> None:
    # A regular package at the root shadows any module of its name for tools
    # started there; a namespace portion cannot.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "runtime" / "__init__.py").exists()
