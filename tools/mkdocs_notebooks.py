"""mkdocs hook: every notebook under ``notebooks/`` becomes a page ``tutorial/{name}.md`` of the site.

The page is the notebook as it is in the repository (notebooks are stored without outputs): its
markdown cells, and its code cells as Python blocks, under a line saying how to run it. Built at
each ``mkdocs build``, so that the pages never lag behind the notebooks; no dependency beyond mkdocs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def notebook_markdown(path: Path) -> str:
    """The markdown page of one notebook."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    parts = []
    for i, cell in enumerate(nb.get("cells", [])):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else str(source)
        if cell.get("cell_type") == "markdown":
            parts.append(text.strip())
        elif cell.get("cell_type") == "code" and text.strip():
            if "```" in text:
                raise ValueError(f"{path.name}, cell {i}: a code cell holding ``` cannot be shown in a fenced block")
            parts.append("```python\n" + text.rstrip() + "\n```")
        if i == 0:  # under the title
            parts.append(f"*This page is the notebook `notebooks/{path.name}`: read it here, or run it in "
                         "Jupyter (`.venv/bin/pip install jupyterlab && "
                         f".venv/bin/jupyter lab notebooks/{path.name}`).*")
    return "\n\n".join(parts) + "\n"


def on_files(files: Any, config: Any) -> Any:
    """mkdocs event: add the notebook pages to the site's files."""
    from mkdocs.structure.files import File

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, f"tutorial/{path.stem}.md", content=notebook_markdown(path)))
    return files
