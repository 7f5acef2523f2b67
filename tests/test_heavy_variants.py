"""tests/heavy_variants.txt names tests that exist: a renamed test must not leave the list (and the slow run)."""

import ast
import re

from conftest import ROOT, heavy_variants


def test_every_heavy_variant_names_a_test_function():
    missing = []
    for nodeid in sorted(heavy_variants()):
        path, _, rest = nodeid.partition("::")
        name = re.sub(r"\[.*$", "", rest)
        file = ROOT / path
        defined = set()
        if file.is_file():
            defined = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
        if name not in defined:
            missing.append(nodeid)
    assert heavy_variants() and not missing, missing
