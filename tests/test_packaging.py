"""The wheel carries the package: kernels, integrations, tools, py.typed, the console script and the extras; its long
description renders on a package index, with no repository beside it.

Builds from a copy of the project files in a temporary directory (`pip wheel --no-deps --no-build-isolation`,
setuptools from the test environment; about 2 s), then imports flashtriton from the unpacked wheel.
"""

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("setuptools")
# what the index shows: `readme` in pyproject.toml
README = re.search(r'^readme\s*=\s*(?:"([^"]+)"|\{[^}]*file\s*=\s*"([^"]+)")', (ROOT / "pyproject.toml").read_text(),
                   re.M)
README = next(g for g in README.groups() if g)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pkg")
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE", README):
        if (ROOT / name).exists():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
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
        "flashtriton/tools/__init__.py",
        "flashtriton/tools/bench.py",
        "flashtriton/tools/checks.py",
        "flashtriton/tools/tune.py",
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


# links and images: markdown inline `[text](target)` / `![alt](target)`, reference definitions `[id]: target`, and
# HTML src= / href=
LINK_TARGETS = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)|^ {0,3}\[[^\]]+\]:\s*<?(\S*?)>?(?:\s|$)"
                          r"|\b(?:src|href)\s*=\s*[\"']([^\"']*)", re.M)
ABSOLUTE = ("http://", "https://", "mailto:", "#")
REPOSITORY_ONLY = ("benchmarks/", "docs/", "notebooks/", "scripts/", "tests/", "src/", ".ci/", "Makefile", "make ")


def relative_targets(text: str) -> list[str]:
    """The link and image targets in markdown `text` that need files beside it (not absolute, not in-page)."""
    found = [next(g for g in m.groups() if g is not None) for m in LINK_TARGETS.finditer(text)]
    return [t for t in found if not t.startswith(ABSOLUTE)]


def test_relative_targets_finds_links_and_images():
    text = ("[a](docs/x.md) ![b](img.png) [c](https://x.org) [d](#usage)\n[e]: ../f.md\n"
            '<img src="p.png"> <a href="http://x.org">')
    assert relative_targets(text) == ["docs/x.md", "img.png", "../f.md", "p.png"]


def test_long_description_stands_alone(wheel):
    """The METADATA body (what an index renders): markdown, with no relative link or image and no path or command
    that only the repository has."""
    archive = zipfile.ZipFile(wheel)
    dist_info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    message = email.message_from_string(archive.read(f"{dist_info}/METADATA").decode())
    assert message["Description-Content-Type"].startswith("text/markdown")
    body = message.get_payload()
    assert body.strip() == (ROOT / README).read_text().strip()
    assert not relative_targets(body), relative_targets(body)
    named = [r for r in REPOSITORY_ONLY if r in body]
    assert not named, f"{README} names what only the repository has: {named}"
