"""The seed's seven-checkpoint example, replayed through the public API and read back with the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import ftidask
from ftidask.tools.cli import main as cli_main

SEED = json.loads((Path(__file__).parent / "data" / "seed_example.json").read_text())
FIELDS = ("id", "idx", "containerid", "hascontent", "dptr", "fptr", "chunksize", "containersize")


def _file_of(ctx, info):
    (path,) = (Path(ctx.paths.level_dir(info.level, 0))).glob(f"ckpt{info.id}.s{info.seq}/Ckpt{info.id}-Rank0.fti")
    return path


def test_seed_example_byte_offsets(dirs, capsys):
    ctx = ftidask.init(**dirs)
    arrays = {}
    rng = np.random.default_rng(0)
    for step in SEED:
        for vid, count in step["protect"]:
            arrays[vid] = rng.integers(-2**31, 2**31 - 1, size=count, dtype=np.int32)
            ctx.protect(vid, arrays[vid])
        info = ctx.checkpoint(step["ckpt_id"], 1)
        path = _file_of(ctx, info)
        assert cli_main(["inspect", "--json", str(path)]) == 0
        got = json.loads(capsys.readouterr().out)
        assert len(got["blocks"]) == len(step["blocks"]), f"checkpoint {step['checkpoint']}"
        for bi, (gb, eb) in enumerate(zip(got["blocks"], step["blocks"])):
            assert (gb["numvars"], gb["dbsize"]) == (eb["numvars"], eb["dbsize"]), f"ckpt {step['checkpoint']} block {bi}"
            for gv, ev in zip(gb["vars"], eb["vars"]):
                assert {k: gv[k] for k in FIELDS} == ev, f"ckpt {step['checkpoint']} block {bi}"
    # The real command line prints the seed's labels for the last table.
    out = subprocess.run([sys.executable, "-m", "ftidask", "inspect", str(path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent).stdout
    assert "DATASTRUCTURE BEGIN" in out and "DataBase-id: 4" in out and "hascontent: false" in out
    assert "fptr: 100000732" in out
    # And the last checkpoint recovers bit for bit in a new run.
    expected = {vid: a.copy() for vid, a in arrays.items()}
    ctx2 = ftidask.init(**dirs)
    fresh = {vid: np.zeros_like(a) for vid, a in arrays.items()}
    for vid in sorted(fresh):
        ctx2.protect(vid, fresh[vid])
    ctx2.recover()
    for vid in expected:
        assert fresh[vid].tobytes() == expected[vid].tobytes()
