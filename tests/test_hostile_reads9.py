"""Files of FTI's own I/O (POSIX, MPI-IO, level-3 groups) that are hostile or odd: a size this machine cannot hold,
group files that disagree, members left padded or replaced by a directory. Each case was found by a review."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: A child process whose address space is 2 GiB: a file's size larger than that cannot be read whole there.
LIMITED = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
           "from ftidask.tools.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("name", ["Ckpt1-Rank0.fti", "Ckpt1-mpiio.fti"])
def test_a_file_larger_than_memory_is_a_clean_error(tmp_path, name):
    """A POSIX or MPI-IO file whose meta file gives 8 GiB (a sparse file: nothing on disk) was read into a buffer
    of its size before any check: a raw MemoryError traceback (exit 1), and recover_fti_run stopped its search there
    instead of trying the next level. A RecoveryError now: one line, exit status 2."""
    size = 8 << 30
    with open(tmp_path / name, "wb") as fh:
        fh.truncate(size)
    meta = tmp_path / "sector0-group0.fti"
    meta.write_text(f"[0]\nckpt_file_name = Ckpt1-Rank0.fti\nckpt_file_size = {size}\nckpt_file_maxs = {size}\n"
                    f"ckpt_checksum = {'0' * 32}\nvar0_id = 0\nvar0_size = 8\n")
    proc = subprocess.run([sys.executable, "-c", LIMITED, "verify", str(tmp_path / name), "--meta", str(meta)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "not enough memory to read the file's 8,589,934,592 bytes whole" in proc.stderr, proc.stderr
