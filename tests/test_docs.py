"""The documentation builds without a warning, and the config reference lists every key."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ftidask.model.config import config_keys

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -e '.[all,test]'"


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
    # The home page as rendered: a code fence closed with a comment after it once swallowed the rest
    home = (tmp_path / "site" / "index.html").read_text()
    assert '<h2 id="install">' in home and "<li><strong>Levels 1-4</strong>" in home, home
    assert "pip install -e &#x27;.[all,test]&#x27;" in home or "pip install -e '.[all,test]'" in home
    for notebook in NOTEBOOKS:  # rendered as tutorial pages
        page = (tmp_path / "site" / "tutorial" / notebook.stem / "index.html").read_text()
        assert "<h1" in page and "language-python" in page, notebook.name
    for internal in ("StagingMixin", "ThreadMover", "write_ftiff", "zarr_store", "add_export_command", "RecoveryCalls"):
        assert internal not in api, internal
    # The docstrings rendered there point only to what the page documents (api.md: other modules are internal).
    import html

    import ftidask

    targets = re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.M)
    named = set(re.findall(r"\bftidask(?:\.\w+)+", html.unescape(re.sub(r"<[^>]+>", " ", api))))
    internal = sorted(n for n in named if n.split(".")[1] not in ftidask.__all__
                      and not any(n == t or n.startswith(t + ".") or t.startswith(n + ".") for t in targets))
    assert not internal, f"the API page's docstrings name internal modules: {internal}"


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
    generated = {f"tutorial/{p.stem}.md" for p in NOTEBOOKS}  # made from the notebooks at build time
    for page in nav:
        assert (ROOT / "docs" / page).is_file() or page in generated, page
    assert generated <= set(nav), "every notebook has its page in the nav"


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_code_fences_are_closed_by_a_bare_fence(path):
    """Markdown closes a fence only with a bare ```: ``` followed by anything else opens nothing and
    closes nothing, and the rest of the page becomes code."""
    opened = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        if opened is None:
            opened = number
        else:
            assert line.strip() == "```", f"{path.name}:{number}: a fence opened at line {opened} is closed by {line!r}"
            opened = None
    assert opened is None, f"{path.name}: the fence opened at line {opened} is never closed"


def test_home_page_and_readme_agree_on_install():
    assert INSTALL in (ROOT / "README.md").read_text()
    assert INSTALL in (ROOT / "docs" / "index.md").read_text()
    assert INSTALL in (ROOT / "docs" / "installation.md").read_text()


def test_readme_ships_the_config_it_uses():
    readme = (ROOT / "README.md").read_text()
    assert "config.fti" in readme and "examples/config.fti" in readme
    assert (ROOT / "examples" / "config.fti").is_file()  # loaded and used by tests/test_cli_errors.py


def test_api_reference_lists_public_names_only():
    import importlib

    import ftidask
    from ftidask.model import constants, errors
    from ftidask.staging import stager as staging
    from ftidask.tools import fti_run, zarr_export

    public = [getattr(ftidask, name) for name in ftidask.__all__] + [constants, errors]
    public += [zarr_export.export_checkpoint, zarr_export.ExportResult, zarr_export.import_zarr, zarr_export.read_zarr]
    public.append(staging.StageInfo)  # what the public Context.stage_info returns
    public += [fti_run.recover_fti_run, fti_run.fti_run_files, fti_run.FtiRunFile,  # runs FTI wrote
               fti_run.global_rank, fti_run.app_rank]  # and their ranks, with heads
    targets = re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.M)
    assert targets
    for target in targets:
        module, _, name = target.rpartition(".")
        try:
            obj = importlib.import_module(target)
        except ImportError:
            obj = getattr(importlib.import_module(module), name)
        assert any(obj is p for p in public), f"docs/api.md documents {target}, which is not public API"
