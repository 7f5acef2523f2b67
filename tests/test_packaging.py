"""What ships: the sdist holds every source a build needs, and a wheel built from it has the native kernel.

pip builds from the sdist wherever no wheel fits the machine. The extension is optional (a machine without a
compiler still installs), so a header missing from the sdist does not fail the install: it silently drops
``ftidask._native`` (slow hashing and L3 coding, no copy-on-write snapshots). These tests make that loud.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {".py", ".c", ".h"}


def package_sources() -> set[str]:
    """The package's files that must ship, relative to the repository root (build outputs left out)."""
    found = set()
    for path in (ROOT / "ftidask").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and (path.suffix in SHIPPED or path.name == "LICENSE"):
            found.add(path.relative_to(ROOT).as_posix())
    return found


def build(*args: str, outdir: Path) -> Path:
    """Run ``python -m build`` without isolation (the test venv has the build requirements) and return the file."""
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (made,) = [p for p in outdir.iterdir() if p.suffix in {".gz", ".whl"}]
    return made


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy without build leftovers: setuptools also reads an old ftidask.egg-info/SOURCES.txt, which in a
    # developer's tree still lists what an earlier build shipped and would hide a file the manifest now misses.
    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "ftidask", tree / "ftidask",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.o", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, tree / name)
    return build("--sdist", str(tree), outdir=tmp_path_factory.mktemp("sdist"))


def test_sdist_holds_every_source_header_and_license(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = package_sources() - names
    assert not missing, f"not in the sdist: {sorted(missing)}"
    for needed in ("LICENSE", "pyproject.toml", "setup.py", "README.md", "ftidask/csrc/xxhash/xxhash.h"):
        assert needed in names
    assert not [n for n in names if n.endswith((".so", ".pyc"))], "build outputs in the sdist"


@pytest.mark.slow
def test_wheel_built_from_the_sdist_has_the_native_kernel(sdist: Path, tmp_path: Path) -> None:
    wheel = build("--wheel", str(sdist), outdir=tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        whl.extractall(tmp_path / "site")
    assert [n for n in names if n.startswith("ftidask/_native") and n.endswith(".so")], names
    assert [n for n in names if n.endswith("licenses/LICENSE")], "the license is not in the wheel's metadata"
    probe = ("import ftidask, sys; from ftidask.ftiff import blockhash; from ftidask.levels import gf_native; "
             "assert ftidask.__file__.startswith(sys.argv[1]), ftidask.__file__; "
             "assert blockhash.native_kernel(); assert gf_native.isa() is not None")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "site")], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
