"""A restart on another number of ranks (3 -> 2) where one rank runs out of memory while it stages (its address space
limited for real, RLIMIT_AS): every rank refuses the checkpoint with the same error, no array touched, and a recovery
after the limit is lifted fills them exactly. Before, the staging buffers were allocated outside the agreed part of
ftidask.engine.reshard._stage: that rank raised a MemoryError alone, the others waited for it in a collective. Now
arrays that take no moved pages have no buffer (verified, then read into after the agreement): what that rank cannot
have is the threads that verify (a thread's stack is address space too)."""

from __future__ import annotations

import json
from pathlib import Path

from mpi_util import need_mpi, run

pytestmark = need_mpi()


def test_a_rank_out_of_memory_for_its_buffer_refuses_on_every_rank(tmp_path: Path) -> None:
    run(3, "reshard_oom_job.py", "write", str(tmp_path), timeout=120)
    proc = run(2, "reshard_oom_job.py", "recover", str(tmp_path), timeout=120, check=False)
    results = [json.loads(p.read_text()) if (p := tmp_path / f"result-{r}.json").exists() else None
               for r in range(2)]
    assert None not in results, (proc.returncode, proc.stderr[-3000:])
    assert results[0]["first"] == results[1]["first"], results
    first = results[0]["first"]
    assert first.startswith("NoCheckpointError") and ("MemoryError" in first or "can't start new thread" in first), first
    assert all(r["untouched"] and r["exact"] for r in results), results
