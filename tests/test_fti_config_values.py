"""Config values read as FTI's iniparser reads them (``parse_line`` of iniparser 3/4, FTI's deps/iniparser).

iniparser takes a quoted value between its quotes (spaces kept, whatever follows the closing quote dropped, ``""``
empty) and an unquoted one up to its first ``;`` or ``#``, whether or not a space comes before it. A config that FTI
reads as ``ckpt_dir = ./My Local`` must not become a directory whose name holds the quotes.
"""

from __future__ import annotations

import pytest

import ftidask


@pytest.mark.parametrize(("line", "key", "value"), [
    ('ckpt_dir = "./My Local"', "ckpt_dir", "./My Local"),
    ("ckpt_dir = './My Local'  ; a comment", "ckpt_dir", "./My Local"),
    ('ckpt_dir = "./a;b#c" # quoted: kept', "ckpt_dir", "./a;b#c"),
    ("ckpt_dir = ./Local#no space before it", "ckpt_dir", "./Local"),
    ("ckpt_dir = ./Local;no space before it", "ckpt_dir", "./Local"),
    ("ckpt_l1 = 3#every 3 minutes", "ckpt_l1", 3),
    ("ckpt_l1 = 3 ; every 3 minutes", "ckpt_l1", 3),
    ("ckpt_l1 = '7'", "ckpt_l1", 7),
    # iniparser_getint is strtol(value, NULL, 0): octal and hexadecimal as C reads them (010 was read as 10 here)
    ("ckpt_l1 = 010", "ckpt_l1", 8),
    ("ckpt_l1 = 0x10", "ckpt_l1", 16),
    ("ckpt_l1 = 0", "ckpt_l1", 0),
    # a key of FTI's own example configs, of no use here (it was refused as unknown)
    ("profile_dir = ./Profile/", "ckpt_l1", 0),
])
def test_values_are_read_as_iniparser_reads_them(tmp_path, line, key, value):
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[basic]\n{line}\n")
    assert getattr(ftidask.load_config(cfg), key) == value


@pytest.mark.parametrize("value", ['""', "''", "", "# nothing", "NULL"])
def test_an_empty_exec_id_is_none(tmp_path, value):
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[restart]\nfailure = 0\nexec_id = {value}\n")
    assert ftidask.load_config(cfg).exec_id is None


def test_a_config_rewritten_by_fti_update_conf_loads(tmp_path):
    """FTI_UpdateConf rewrites the file with iniparser_dump_ini: lower-case sections and keys, ``%-30s = %s``,
    comments gone; the restart section then names the run."""
    cfg = tmp_path / "config.fti"
    cfg.write_text("\n[basic]\nhead                           = 0\nckpt_dir                       = ./Local\n"
                   "ckpt_l1                        = 1\nckpt_io                        = 3\n\n\n[restart]\n"
                   "failure                        = 1\nexec_id                        = 2017-11-24_14-09-26\n\n\n"
                   "[injection]\nrank                           = 0\n\n\n[advanced]\n"
                   "block_size                     = 1024\nlustre_striping_factor         = -1\n\n\n")
    config = ftidask.load_config(cfg)
    assert (config.failure, config.exec_id, config.ckpt_dir, config.ckpt_l1) == (1, "2017-11-24_14-09-26", "./Local", 1)


@pytest.mark.parametrize("value", ["true", "No", "ON", "off", "1"])
def test_booleans_as_docs_config_md_lists_them(tmp_path, value):
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[basic]\nkeep_last_ckpt = {value}\n")
    assert ftidask.load_config(cfg).keep_last_ckpt is (value.lower() in ("true", "on", "1"))


def test_a_bad_boolean_names_every_accepted_form():
    """The error said 'expected 0 or 1' of a key that also takes true/false, yes/no, on/off (docs/config.md)."""
    with pytest.raises(ftidask.ConfigError, match=r"keep_last_ckpt.*0/1, true/false, yes/no or on/off, got 'maybe'"):
        ftidask.load_config(None, keep_last_ckpt="maybe")


def test_an_indented_line_is_a_key_of_its_own(tmp_path):
    """configparser took an indented line for the continuation of the value before: ckpt_dir became
    "./Local\\nckpt_l1 = 5" (a directory with a newline in its name), ckpt_l1 stayed unset. iniparser strips it."""
    cfg = tmp_path / "config.fti"
    cfg.write_text("[basic]\nckpt_dir = ./Local\n   ckpt_l1 = 5\n\t[advanced]\n  block_size = 2048\n")
    loaded = ftidask.load_config(cfg)
    assert (loaded.ckpt_dir.endswith("Local"), loaded.ckpt_l1, loaded.block_size) == (True, 5, 2048)


@pytest.mark.parametrize("value", ["08", "5min", "1_0", "\u0663", "0x"])
def test_an_integer_c_would_cut_short_is_refused(tmp_path, value):
    """strtol reads ``08`` as 0 and ``5min`` as 5: a value FTI reads otherwise than it looks is refused, clearly."""
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[basic]\nckpt_l1 = {value}\n", encoding="utf-8")
    with pytest.raises(ftidask.ConfigError, match="expected an integer"):
        ftidask.load_config(cfg)


def test_a_group_larger_than_the_reed_solomon_code_is_refused():
    """L3 encodes as many parity files as data files over GF(2^8): 128 members at most (129 was accepted, then L3
    failed with a raw ValueError from the codec)."""
    assert ftidask.load_config(None, group_size=128).group_size == 128
    with pytest.raises(ftidask.ConfigError, match="group_size"):
        ftidask.load_config(None, group_size=129)


@pytest.mark.parametrize("value", ["9" * 5000, "0x" + "f" * 100])
def test_an_integer_of_thousands_of_digits_is_a_config_error(value):
    """int() refuses over 4300 digits with a raw ValueError (on MPI, the other ranks then waited in init)."""
    with pytest.raises(ftidask.ConfigError, match=r"characters\) is outside"):
        ftidask.load_config(None, ckpt_l1=value)


@pytest.mark.parametrize(("text", "want"), [
    # a key set twice: iniparser keeps the last value (configparser's strict mode refused the file)
    ("[basic]\nckpt_l1 = 1\nckpt_l1 = 2\n", {"ckpt_l1": 2}),
    # a section given twice: merged
    ("[basic]\nckpt_l1 = 1\n[advanced]\nlocal_test = 1\n[basic]\nckpt_l2 = 2\n", {"ckpt_l1": 1, "ckpt_l2": 2}),
    # a value continued by a trailing backslash: the lines joined, the continuation's blanks kept
    ("[basic]\nckpt_dir = ./Lo\\\ncal\n", {"ckpt_dir": "./Local"}),
    ("[basic]\nckpt_dir = ./My\\\n Local \\\nDir\nckpt_l1 = 4\n", {"ckpt_dir": "./My Local Dir", "ckpt_l1": 4}),
])
def test_files_fti_loads_are_loaded_alike(tmp_path, text, want):
    """FTI's iniparser loads these (found by a review: ftidask refused them as not valid INI files)."""
    cfg = tmp_path / "config.fti"
    cfg.write_text(text)
    got = ftidask.load_config(cfg)
    assert {key: getattr(got, key) for key in want} == want


def test_fti_keys_ignored_in_a_file_are_ignored_as_keywords_too():
    """``ckpt_net = 1`` loads from a file (an FTI key of no use here); ``init(ckpt_net=1)`` was an unknown key."""
    base = ftidask.load_config(None)
    assert ftidask.load_config(None, ckpt_net=1, general_tag=3, lustre_stiping_unit=4) == base
    with pytest.raises(ftidask.ConfigError, match="unknown config key 'ckpt_nett'"):
        ftidask.load_config(None, ckpt_nett=1)


def test_fti_s_own_test_template_values_load(tmp_path):
    """FTI's test suites' template says ``dcp_block_size = -1`` with ``enable_dcp = 0`` (FTI checks the block size
    with dCP on only), ``max_sync_intv = -1`` is FTI's own default (512), and FTI reads its booleans with
    iniparser_getboolean (t/T/y/Y true, f/F/n/N false): all were refused."""
    path = tmp_path / "config.fti"
    path.write_text("[basic]\nnode_size = 4\ngroup_size = 4\nckpt_io = 1\nverbosity = 2\nmax_sync_intv = -1\n"
                    "enable_dcp = 0\ndcp_mode = 1\ndcp_block_size = -1\ndcp_stack_size = 5\nenable_staging = N\n"
                    "keep_last_ckpt = f\n[restart]\nfailure = 0\nexec_id = NULL\n"
                    "[injection]\nrank = 0\nnumber = 0\nposition = 0\nfrequency = 0\n")
    config = ftidask.load_config(str(path))
    assert (config.enable_dcp, config.dcp_block_size, config.max_sync_intv) == (False, -1, 0)
    assert (config.enable_staging, config.keep_last_ckpt) == (False, False)
    assert ftidask.load_config(None, enable_dcp="T", dcp_block_size=4096).enable_dcp is True
    with pytest.raises(ftidask.ConfigError, match="dcp_block_size.*outside"):
        ftidask.load_config(None, enable_dcp="y", dcp_block_size=-1)


def test_a_block_size_unused_without_dcp_is_refused_when_dcp_is_turned_on_later(tmp_path, dirs):
    """The template's ``dcp_block_size = -1`` with dCP off is kept as written: turning dCP on afterwards (replace,
    base=, init's keywords over the file) is refused. Before, it was rewritten to 16384 at load, and dCP ran with
    a block size the file never said."""
    path = tmp_path / "config.fti"
    path.write_text("[basic]\nenable_dcp = 0\ndcp_block_size = -1\n")
    config = ftidask.load_config(str(path))
    for turned_on in (lambda: config.replace(enable_dcp=1), lambda: ftidask.load_config(None, base=config, enable_dcp=1),
                      lambda: ftidask.init(config, enable_dcp=1, **dirs)):
        with pytest.raises(ftidask.ConfigError, match=r"dcp_block_size': -1 is outside \[512, 65535\]"):
            turned_on()
    ftidask.init(config, **dirs).finalize()  # dCP off: unused
