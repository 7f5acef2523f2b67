"""The MPI backend driven by seeded random sequences of calls and real failures, checked against a model.

tests/mpi_scripts/random_sequence_job.py runs on 4 ranks (nodes of 1 or 2 ranks, groups of 2 or 4 nodes, with and
without dCP). Every rank draws the same operations from the seed: arrays changed or resized, checkpoints at every
level waited for or not, incremental checkpoints, recover / recover_var, restarts (the context closed without
finalize), a node's files lost at a restart, a file of a checkpoint erased or a byte of it flipped. The model keeps
each committed checkpoint, FTI's retention and the state of each of its files; every recovery must give, on every
rank, exactly the checkpoint the model knows recoverable (its damage within the level's tolerance: L2 a file and its
partner copy not both lost, L3 at most half of a group's files), or, where the damage may be beyond, a whole
committed checkpoint tried before it or NoCheckpointError with the arrays untouched. A hang fails at the timeout.

A byte flipped in a container's slack (bytes FTI-FF keeps when a variable shrinks) is not detected by the file's
hashes; at L3 such a file spoiled the Reed-Solomon rebuild of another lost file of its group when it was one of the
decoding's inputs, which takes the parity files first (dcp-n1g4 seed 120 of the first version of this driver: the data
files were taken first). A full encoding's parity records keep the group's whole-file hashes, which tell such a file
apart (it counts as lost); a parity patched by a rank's differential writer keeps none: with dCP, where a parity file
is lost too, the model promises nothing.

With heads (configs ``h-*``: 2 or 4 simulated nodes of 1 head + 2 or 1 application ranks, the heads raising L2-L4
and the dCP levels, one config with inline L2, two with keep_last_ckpt), the same model holds: each check waits for
the heads' post-processing first and asks that it succeeded; the heads take part in every init (restarts too) and end
at each close or finalize; with keep_last_ckpt a finalize restarts the run from the newest checkpoint whose files all
verify (status 2), or fails on every rank when none does (the run kept, status 1).

Hypothesis cannot drive several MPI ranks: the seeds are the sequences. A failing seed reproduces with
``mpiexec -n 4 python tests/mpi_scripts/random_sequence_job.py CONFIG DIR STEPS SEED`` (-n HEADS[CONFIG] with heads).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()

CONFIGS = ["n1g4", "n1g2", "n2g2", "dcp-n1g4", "dcp-n2g2"]
#: With heads (head = 1, the heads raise L2-L4, see the job's CONFIGS): config -> processes (heads included).
HEADS = {"h-n3g2": 6, "h-n2g2-keep": 8, "h-n3g2-l2inline": 6, "h-dcp-n3g2": 6, "h-dcp-n2g2-keep": 8}


def _run_seeds(tmp_path: Path, config: str, steps: int, seeds: list[int], timeout: float) -> None:
    try:
        run(HEADS.get(config, 4), "random_sequence_job.py", config, str(tmp_path), str(steps), *map(str, seeds),
            timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # a hang: where it stopped (the job prints each seed and operation)
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        raise AssertionError(f"{config}: no answer in {timeout} s; the job's last lines:\n{out[-3000:]}") from None
    problems = []
    for seed in seeds:
        result = json.loads((tmp_path / f"result-{seed}.json").read_text())
        if not result["ok"]:
            problems.append(f"{config} seed {seed}: {result['error']}\nlast operations:\n  "
                            + "\n  ".join(result["log"][-20:]))
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("config", ["n1g4", "dcp-n2g2"])
def test_random_sequences_recover_what_the_model_predicts(tmp_path, config):
    _run_seeds(tmp_path, config, steps=16, seeds=[1], timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("config", CONFIGS)
def test_random_sequences_recover_what_the_model_predicts_many_seeds(tmp_path, config):
    # dcp-n2g2 seed 5: recover(ckpt_id=...) of an older checkpoint, then recover(): realloc gave the older one's sizes
    _run_seeds(tmp_path, config, steps=40, seeds=[5, *range(200, 207)], timeout=900)


@pytest.mark.campaign
@pytest.mark.timeout(3700)
@pytest.mark.parametrize("config", CONFIGS)
def test_random_sequences_recover_what_the_model_predicts_campaign(tmp_path, config):
    """-m campaign: more seeds, longer sequences."""
    _run_seeds(tmp_path, config, steps=80, seeds=list(range(300, 340)), timeout=3600)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,seeds", [("h-n3g2", [10]), ("h-dcp-n2g2-keep", [10]), ("h-dcp-n3g2", [11])])
def test_random_sequences_with_heads(tmp_path, config, seeds):
    """Heads raise the checkpoints; restarts re-init heads and ranks, finalize with keep_last_ckpt restarts (status
    2), nodes lost and files damaged between runs: the model's prediction holds as without heads."""
    _run_seeds(tmp_path, config, steps=30, seeds=seeds, timeout=500)


@pytest.mark.campaign
@pytest.mark.timeout(3700)
@pytest.mark.parametrize("config", list(HEADS))
def test_random_sequences_with_heads_campaign(tmp_path, config):
    """-m campaign: more seeds, longer sequences, with heads."""
    _run_seeds(tmp_path, config, steps=60, seeds=list(range(300, 330)), timeout=3600)
