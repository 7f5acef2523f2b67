"""The documentation builds without a warning, and the config reference lists every key."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ftidask.config import config_keys

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "export_checkpoint" in api and "Context" in api and "protect" in api  # docstrings rendered


def test_config_reference_lists_every_key():
    text = (ROOT / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    missing = set(config_keys()) - documented
    assert not missing, f"docs/config.md does not document {sorted(missing)}"
    unknown = documented - set(config_keys())
    assert not unknown, f"docs/config.md documents keys that do not exist: {sorted(unknown)}"


def test_nav_pages_exist():
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav
    for page in nav:
        assert (ROOT / "docs" / page).is_file(), page
