"""The wheel carries the package: kernels, integrations, py.typed, the console script and the extras.

Builds from a copy of the project files in a temporary directory (`pip wheel --no-deps --no-build-isolation`,
setuptools from the test environment; about 2 s), then imports flashtriton from the unpacked wheel.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("setuptools")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pkg")
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, work / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", "dist"],
        cwd=work, check=True, capture_output=True, text=True, timeout=120,
    )
    (built,) = (work / "dist").glob("flashtriton-*.whl")
    return built


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "flashtriton/__init__.py",
        "flashtriton/py.typed",
        "flashtriton/ops.py",
        "flashtriton/kernels/forward.py",
        "flashtriton/kernels/backward.py",
        "flashtriton/integrations/__init__.py",
        "flashtriton/integrations/transformers.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    assert not any("tests/" in n or n.endswith(".pyc") for n in names)
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "flashtriton = flashtriton.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    for extra in ("test", "hf", "notebook"):
        assert f"Provides-Extra: {extra}" in metadata
    # what a package index shows: an SPDX license, classifiers, and numpy only with the interpreter's extra
    assert "License-Expression: MIT" in metadata
    assert "Classifier: Environment :: GPU :: NVIDIA CUDA" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: numpy")]
    assert requires and all("extra ==" in line for line in requires), requires


def test_wheel_imports(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    code = (
        "import flashtriton, flashtriton.kernels.forward, flashtriton.kernels.backward, "
        "flashtriton.integrations.transformers, pathlib; "
        "p = pathlib.Path(flashtriton.__file__); assert p.is_relative_to(pathlib.Path(r'%s')), p; "
        "assert (p.parent / 'py.typed').exists(); print(flashtriton.__version__)" % tmp_path
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
