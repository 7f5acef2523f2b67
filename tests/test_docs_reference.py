"""The reference pages against the code: every config key's default, section and range as docs/config.md states
them (checked by loading the values at and past each bound), every CLI command and option in docs/cli.md, and
every call of the API that the docs write (``ctx.X(...)``, ``ftidask.X(...)``) accepted by the real signature."""

import ast
import inspect
import re

import pytest
from conftest import ROOT

import ftidask
from ftidask.model.config import config_keys, load_config
from ftidask.model.errors import ConfigError
from ftidask.tools.cli import build_parser

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


# --- docs/config.md ------------------------------------------------------------------------------------

def config_rows() -> list[tuple[str, str, str, str]]:
    """``(section, key, default, validation)`` of every row of docs/config.md's tables."""
    rows, section = [], None
    for line in (ROOT / "docs" / "config.md").read_text().splitlines():
        heading = re.fullmatch(r"## \[(\w+)\]", line)
        if heading:
            section = heading.group(1)
        elif line.startswith("## "):
            section = None
        row = re.match(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", line)
        if row:
            rows.append((section, row.group(1), row.group(2).strip(), row.group(3).strip()))
    return rows


ROWS = config_rows()


NEEDS = {"dcp_l4": {"enable_dcp": 1}, "dcp_block_size": {"enable_dcp": 1}}  # keys whose values above 0 need another key (said in their meaning column)


def accepts(key: str, value) -> bool:
    try:
        load_config(None, **{key: value, **NEEDS.get(key, {})})
    except ConfigError:
        return False
    return True


def test_config_rows_name_each_key_once_in_its_own_section():
    keys = config_keys()
    assert sorted(key for _s, key, _d, _v in ROWS) == sorted(keys)
    for section, key, _default, _validation in ROWS:
        assert section == keys[key][0], f"docs/config.md lists {key} under [{section}]; the code reads it in " \
                                        f"[{keys[key][0]}]"


@pytest.mark.parametrize("row", ROWS, ids=[r[1] for r in ROWS])
def test_config_default_as_documented(row):
    _section, key, default, _validation = row
    value = config_keys()[key][1]
    shown = "none" if value is None else str(int(value)) if isinstance(value, bool) else str(value)
    assert default.strip("`") == shown, f"docs/config.md: default of {key} is {default}; the code's is {shown}"
    assert getattr(load_config(None), key) == value


def test_ignored_fti_keys_as_documented(tmp_path):
    """docs/config.md lists the FTI keys accepted and ignored in any section (``name_*`` for a family): the code
    ignores exactly those, and an FTI file holding them all loads."""
    from ftidask.model.config import _IGNORED_KEYS

    text = (ROOT / "docs" / "config.md").read_text()
    paragraph = text[text.index("accepted and ignored"):text.index("## [basic]")]
    listed = re.findall(r"`(\w+\*?)`", paragraph)
    patterns = [re.compile(name.replace("*", r"\w+") + "$") for name in listed if name != "injection"]
    assert "injection" in paragraph
    unlisted = sorted(k for k in _IGNORED_KEYS if not any(p.match(k) for p in patterns))
    assert not unlisted, f"docs/config.md does not list the ignored keys {unlisted}"
    for p in patterns:
        assert any(p.match(k) for k in _IGNORED_KEYS), f"docs/config.md lists {p.pattern}, which the code reads"
    lines = [f"{k} = 1" for k in sorted(_IGNORED_KEYS)]
    (tmp_path / "fti.cfg").write_text("[basic]\n" + "\n".join(lines[::2]) + "\n[advanced]\n"
                                      + "\n".join(lines[1::2]) + "\n[injection]\nrank = 0\nnumber = 2\n")
    assert load_config(tmp_path / "fti.cfg") == load_config(None)


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_other_pages_config_tables_agree(path):
    """Pages that repeat some keys in a table (docs/staging.md, docs/dcp.md: key | section | default) agree."""
    rows = re.findall(r"^\| `(\w+)` \| (basic|restart|advanced) \| `?([\w.-]+)`? \|", path.read_text(), re.M)
    for key, section, default in rows:
        assert key in config_keys(), f"{path.name}: {key} is no config key"
        code_section, value = config_keys()[key]
        shown = "none" if value is None else str(int(value)) if isinstance(value, bool) else str(value)
        assert (section, default) == (code_section, shown), f"{path.name}: {key}: [{section}] {default}; the code: " \
                                                            f"[{code_section}] {shown}"


def documented_range(validation: str) -> tuple[int, int | None] | None:
    """``(lo, hi)`` of an integer validation (``hi`` None: unbounded above, i.e. at most 2^31 - 1)."""
    text = validation.replace("`", "")
    if text in ("boolean", "0 or 1"):
        return 0, 1
    found = re.fullmatch(r"(\d+) ?(?:\.\.|-|to) ?(\d+)", text)
    if found:
        return int(found.group(1)), int(found.group(2))
    if text == "C int (< 0 is 0)":  # any C int (a negative one read as 0)
        return -(2**31), None
    found = re.fullmatch(r"integer >= (\d+)", text)
    return (int(found.group(1)), None) if found else None


@pytest.mark.parametrize("row", ROWS, ids=[r[1] for r in ROWS])
def test_config_validation_as_documented(row):
    """Each documented bound is accepted and the value past it refused; each documented choice accepted."""
    _section, key, _default, validation = row
    bounds = documented_range(validation)
    if bounds is not None:
        lo, hi = bounds
        assert accepts(key, lo) and not accepts(key, lo - 1), (key, validation)
        if hi is None:
            assert accepts(key, 2**31 - 1) and not accepts(key, 2**31), (key, validation)
        else:
            assert accepts(key, hi) and not accepts(key, hi + 1), (key, validation)
        return
    if key == "exec_id":
        assert accepts(key, "a" * 128) and accepts(key, "9-x_y.z")
        assert not accepts(key, "a" * 129) and not accepts(key, ".hidden") and not accepts(key, "a/b")
        return
    if validation == "non-empty path, names <= 255 bytes, <= 3840 bytes in all":
        assert accepts(key, "some/dir") and not accepts(key, "")
        assert accepts(key, "a/" + "n" * 255) and not accepts(key, "a/" + "n" * 256)
        assert accepts(key, "/".join(["d" * 255] * 15)) and not accepts(key, "/".join(["d" * 255] * 16))
        return
    choices = [c.split("[")[0] for c in re.findall(r"`([^`]+)`", validation)]
    if key == "compressor":
        pytest.importorskip("numcodecs")
        choices = [c.replace("CNAME", "zstd") for c in choices]
    assert choices and validation.replace("`", "").replace("[", "").strip(), (key, validation)
    for choice in choices:
        assert accepts(key, choice), f"docs/config.md: {key} = {choice} is documented, the code refuses it"
    assert not accepts(key, "no-such-choice"), key


# --- docs/cli.md -----------------------------------------------------------------------------------------

def cli_commands() -> dict[str, set[str]]:
    """Every subcommand of ``ftidask`` with the options its parser takes (long names, and ``-h`` left out)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: {opt for action in p._actions for opt in action.option_strings if opt not in ("-h", "--help")}
            for name, p in sub.choices.items()}


def test_cli_page_documents_every_command_and_option():
    text = (ROOT / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    commands = cli_commands()
    assert sorted(sections) == sorted(commands), "docs/cli.md has a section per command, no more"
    for name, options in commands.items():
        usage = re.findall(rf"^ftidask {name}\b.*$", sections[name], re.M)
        assert usage, f"docs/cli.md: no usage line for {name}"
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", " ".join(usage)), \
                f"docs/cli.md: ftidask {name} {option} is not in its usage line"
    for usage in re.findall(r"^ftidask (\w+) (.*)$", text, re.M):
        name, rest = usage
        for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest):
            assert option in commands[name], f"docs/cli.md: ftidask {name} has no option {option}"


# --- the calls the docs write ----------------------------------------------------------------------------

def snippets(path) -> list[str]:
    """The Python the page writes: its python blocks and its inline code that parses as Python."""
    text = path.read_text()
    blocks = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S)]
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    return blocks + [m.group(1) for m in re.finditer(r"`([^`\n]+\))`", prose)]


def calls(code: str) -> list[ast.Call]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # prose such as `recover(ids=...)` with placeholders that are not Python
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _contexts() -> list[type]:
    found = [ftidask.Context]
    try:
        from ftidask.backends.dask.context import DaskContext
        found.append(DaskContext)
    except ImportError:
        pass
    return found


# Attributes a context sets in __init__ (not on the class): the docs may name them.
INSTANCE_ATTRIBUTES = {"config", "exec_id", "cluster", "client", "paths"}


def bind_problem(target, call: ast.Call) -> str:
    """Why ``call`` does not fit ``target``'s signature ('' when it does)."""
    if any(isinstance(a, ast.Starred) or isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args) \
            or any(k.arg is None for k in call.keywords):
        return ""  # `f(...)`: arguments left out
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return ""
    try:
        signature.bind(*call.args, **{k.arg: k.value for k in call.keywords})
    except TypeError as exc:
        return str(exc)
    return ""


def _zarr_function(name: str):
    def get():
        from ftidask.tools import zarr_export
        return getattr(zarr_export, name)
    return get


def _lineage_restores():
    from ftidask.backends.dask import lineage
    return lineage.restores


# The public functions outside ftidask.__all__ that the docs call by their bare (imported) name.
FUNCTIONS = {name: _zarr_function(name) for name in ("export_checkpoint", "import_zarr", "read_zarr")}
FUNCTIONS["lineage.restores"] = _lineage_restores


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_documented_calls_fit_the_signatures(path):
    problems = []
    for code in snippets(path):
        for call in calls(code):
            func = call.func
            shown = ast.unparse(call)
            if isinstance(func, ast.Name) and func.id in FUNCTIONS or isinstance(func, ast.Attribute) and \
                    isinstance(func.value, ast.Name) and f"{func.value.id}.{func.attr}" in FUNCTIONS:
                why = bind_problem(FUNCTIONS[ast.unparse(func)](), call)
                if why:
                    problems.append(f"{shown}: {why}")
                continue
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
                continue
            if func.value.id == "ctx":
                owners = [c for c in _contexts() if hasattr(c, func.attr)]
                if not owners:
                    problems.append(f"{shown}: Context has no {func.attr}")
                    continue
                why = [bind_problem(getattr(c, func.attr), ast.Call(func, [ast.Constant(None)] + call.args,
                                                                    call.keywords)) for c in owners]
                if all(why):
                    problems.append(f"{shown}: {why[0]}")
            elif func.value.id == "ftidask":
                if not hasattr(ftidask, func.attr):
                    problems.append(f"{shown}: ftidask has no {func.attr}")
                    continue
                why = bind_problem(getattr(ftidask, func.attr), call)
                if why:
                    problems.append(f"{shown}: {why}")
                if func.attr == "init":  # its keywords besides comm and client are config keys
                    unknown = {k.arg for k in call.keywords} - set(config_keys()) - {"comm", "client", None}
                    if unknown:
                        problems.append(f"{shown}: no config key {sorted(unknown)}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_documented_context_attributes_exist(path):
    """``ctx.NAME`` in the page (code or prose) is a method, property or attribute of a context."""
    text = path.read_text()
    named = set(re.findall(r"\bctx\.(\w+)", text))
    missing = {n for n in named if n not in INSTANCE_ATTRIBUTES and not any(hasattr(c, n) for c in _contexts())}
    assert not missing, f"{path.name} names ctx.{sorted(missing)}, which no context has"


def test_api_page_covers_every_public_name():
    """docs/api.md renders each name of ``ftidask.__all__``: by its own entry, or inside a module it documents."""
    import importlib

    targets = re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.M)
    covered = set()
    for target in targets:
        try:
            module = importlib.import_module(target)
            covered |= {n for n in dir(module) if not n.startswith("_")}
        except ImportError:
            covered.add(target.rpartition(".")[2])
    missing = [name for name in ftidask.__all__ if name not in covered]
    assert not missing, f"docs/api.md does not document {missing}"


# --- files and modules the docs name ---------------------------------------------------------------------

@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_named_repository_files_exist(path):
    text = path.read_text()
    named = set(re.findall(r"(?<![\w/.{])((?:ftidask|tests|benchmarks|examples|notebooks|docs)/[\w/.-]*\w"
                           r"\.(?:py|c|h|ipynb|md|fti|txt|sh|toml))\b", text))
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"{path.name} names files that do not exist: {missing}"


def resolve(dotted: str) -> bool:
    """Whether ``ftidask.a.b.c`` is a module, or an attribute of the longest module prefix."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_named_modules_and_attributes_exist(path):
    pytest.importorskip("distributed")  # the docs name ftidask.backends.dask's modules
    named = set(re.findall(r"`(ftidask(?:\.\w+)+)", path.read_text()))
    missing = sorted(n for n in named if not resolve(n))
    assert not missing, f"{path.name} names {missing}, which do not exist"
