"""tests/heavy_variants.txt and tests/campaign_only.txt name tests that exist: a renamed test must not leave the list
(and the slow run, or the campaigns)."""

import ast
import re

import pytest
from conftest import CAMPAIGN_LIST, HEAVY_LIST, ROOT, heavy_variants


@pytest.mark.parametrize("listed", [HEAVY_LIST, CAMPAIGN_LIST], ids=lambda p: p.name)
def test_every_heavy_variant_names_a_test_function(listed):
    missing = []
    for nodeid in sorted(heavy_variants(listed)):
        path, _, rest = nodeid.partition("::")
        name = re.sub(r"\[.*$", "", rest)
        file = ROOT / path
        defined = set()
        if file.is_file():
            defined = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
        if name not in defined:
            missing.append(nodeid)
    assert heavy_variants(listed) and not missing, missing
