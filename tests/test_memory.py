"""Data is written and read container by container: extra memory stays bounded on a 1 GiB state."""

import pytest
from conftest import run_python

CHILD = r"""
import sys, threading, numpy as np, ftidask

def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024

class Peak:
    def __enter__(self):
        self.base = self.peak = anon(); self.stop = threading.Event()
        self.t = threading.Thread(target=self.run); self.t.start(); return self
    def run(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, anon())
    def __exit__(self, *a):
        self.stop.set(); self.t.join(); self.peak = max(self.peak, anon())

root = sys.argv[1]
dirs = dict(ckpt_dir=root + '/L', glbl_dir=root + '/G', meta_dir=root + '/M', verbosity=3)
arrays = [np.full(2**25, float(i)) for i in range(4)]  # 4 x 256 MiB
ctx = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx.protect(i + 1, a)
with Peak() as w:
    ctx.checkpoint(1, 1)
for a in arrays:
    a[:] = -1
ctx2 = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx2.protect(i + 1, a)
with Peak() as r:
    ctx2.recover()
assert all((a == i).all() for i, a in enumerate(arrays))
print((w.peak - w.base) >> 20, (r.peak - r.base) >> 20)
"""


def test_one_gib_state_bounded_memory(tmp_path):
    out = run_python(CHILD, str(tmp_path), timeout=300).stdout.split()
    write_mib, read_mib = int(out[0]), int(out[1])
    assert write_mib < 64, f"checkpoint used {write_mib} MiB of extra anonymous memory"
    assert read_mib < 64, f"recovery used {read_mib} MiB of extra anonymous memory"


# The peak resident memory of the call alone: VmHWM, reset to the current RSS just before it (Linux 4.0+), exact
# where a sampling thread could miss a short peak.
PEAK = r"""
def rss(key='VmRSS'):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1]) * 1024

def peak_of(call):
    base = rss()
    open('/proc/self/clear_refs', 'w').write('5')
    call()
    return rss('VmHWM') - base
"""

COMPRESSED_IN_USE = PEAK + r"""
import sys, numpy as np, ftidask
root, which = sys.argv[1], sys.argv[2]
dirs = dict(ckpt_dir=root + '/L', glbl_dir=root + '/G', meta_dir=root + '/M', verbosity=4, compressor='zstd')
n = 2**23  # 2 x 64 MiB
arrays = [np.arange(n, dtype=np.float64) * (i + 1) for i in range(2)]
ctx = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx.protect(i + 1, a)
ctx.checkpoint(1, 1)
for a in arrays:
    a[:] = -1  # the arrays in use: recovered into as they are, after every container is verified
ctx2 = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx2.protect(i + 1, a)
extra = peak_of(ctx2.recover if which == 'all' else lambda: ctx2.recover_var(1))
assert (arrays[0] == np.arange(n)).all()
assert (arrays[1] == (2 * np.arange(n) if which == 'all' else -1)).all()
print(extra >> 20)
"""


@pytest.mark.parametrize("which", ["all", "var"])
def test_compressed_recovery_into_arrays_in_use(tmp_path, which):
    """A compressed container was decoded aside, frame by frame, the frames joined, then copied into the array:
    two copies of the raw container at once (decoded on two threads: 3.2x the largest array of 256 MiB beside
    the arrays, 812 MiB; recover_var 2.1x). It is now decoded straight into the array, verified first as
    before: what is held is the stored (compressed) bytes of the containers being decoded, and the verification's
    fixed buffers (a ring of 2 MiB reads per verifying thread, a 4 MiB frame per decoding thread: ~33 MiB here)."""
    pytest.importorskip("numcodecs")
    extra = int(run_python(COMPRESSED_IN_USE, str(tmp_path), which, timeout=300).stdout.split()[-1])
    assert extra < 48, f"recovering 2 x 64 MiB compressed into the arrays in use took {extra} MiB more"


@pytest.mark.mpi
def test_differential_l3_parity_update_holds_a_stripe_of_each_member(tmp_path):
    """A differential L3 checkpoint patches the parity from the group's XOR deltas. Each member held its delta in
    pieces, then joined (a second copy), then padded (a third), and gathered every member's whole (the group size
    times more): a checkpoint that changed its whole state of 256 MiB took 1858 MiB beyond it on a rank of a group
    of 4 (7.3x). The pieces are kept as they are and the deltas exchanged a stripe (4 MiB) of each member at a time:
    one copy of the changed bytes and a few stripes."""
    import json

    from mpi_util import need_mpi, run

    if any(mark.name == "skipif" and mark.args and mark.args[0] for mark in need_mpi()):
        pytest.skip("needs mpi4py and mpiexec")
    run(2, "memory_job.py", str(tmp_path), "64", timeout=240)
    for rank in range(2):
        got = json.loads((tmp_path / f"memory-{rank}.json").read_text())
        assert got["patched"], "the parity was encoded again, not patched from the deltas: nothing measured"
        extra = got["extra"] >> 20
        assert extra < 120, f"rank {rank}: a differential L3 checkpoint of 64 MiB, all changed, took {extra} MiB more"


@pytest.mark.mpi
@pytest.mark.slow
def test_differential_l3_of_a_whole_changed_state_keeps_its_delta_out_of_memory(tmp_path):
    """The XOR delta of a differential L3 checkpoint (level 7) is taken as the rank file is patched in place (its old
    bytes are gone after), and the parity patched from it after the file is complete: a checkpoint that changed its
    whole state held a copy of it (160 MiB per rank here: 190-214 MiB beyond it on main, 54-70 now). Past
    ``files.XOR_IN_MEMORY`` (16 MiB) the delta goes to an unnamed scratch file beside the spare: what is left is the
    writer's and the exchange's fixed buffers. The parity stays a full encoding's, byte for byte, and a restart that
    lost node 1 (its file and its parity) rebuilds the checkpoint exactly."""
    import json
    import shutil

    from mpi_util import need_mpi, run
    from test_dcp_mpi import _parity_rows

    if any(mark.name == "skipif" and mark.args and mark.args[0] for mark in need_mpi()):
        pytest.skip("needs mpi4py and mpiexec")
    run(2, "memory_job.py", str(tmp_path), "160", "keep", timeout=300)
    for rank in range(2):
        got = json.loads((tmp_path / f"memory-{rank}.json").read_text())
        assert got["patched"], "the parity was encoded again, not patched from the deltas: nothing measured"
        extra = got["extra"] >> 20
        assert extra < 100, f"rank {rank}: a differential L3 checkpoint of 160 MiB, all changed, took {extra} MiB more"
    own = [next(tmp_path.glob(f"Local/node{r}/*/l3/ckpt3*/Ckpt3-Rank{r}.fti")) for r in range(2)]
    rows = _parity_rows(own)
    for r in range(2):
        assert (own[r].parent / f"Ckpt3-RSed{r}.fti").read_bytes() == rows[r], f"rank {r}: not a full encoding's"
    shutil.rmtree(tmp_path / "Local" / "node1")  # node 1 lost: rank 1's file and parity, its spares
    run(2, "memory_job.py", str(tmp_path), "160", "read", timeout=300)
    for rank in range(2):
        got = json.loads((tmp_path / f"read-{rank}.json").read_text())
        assert got["exact"], f"rank {rank} did not recover the third checkpoint exactly: {got}"


STRIDED_COMPRESSED = PEAK + r"""
import sys, numpy as np, ftidask
root = sys.argv[1]
dirs = dict(ckpt_dir=root + '/L', glbl_dir=root + '/G', meta_dir=root + '/M', verbosity=4, compressor='zstd')
n = 2**24
base = np.zeros((n, 2))
field = base[:, 0]
field[:] = np.arange(n)  # 128 MiB protected, every other double of its base
ctx = ftidask.init(**dirs)
ctx.protect(1, field)
print(peak_of(lambda: ctx.checkpoint(1, 1)) >> 20)
"""


def test_compressed_checkpoint_of_a_strided_array(tmp_path):
    """A container of a non-contiguous array was gathered for its codec as bytes pieces then joined: two copies of
    the raw container (128 MiB: 255 MiB more, the codec's own ~32 MiB included). It is now copied into one buffer of
    its span (160 MiB)."""
    pytest.importorskip("numcodecs")
    extra = int(run_python(STRIDED_COMPRESSED, str(tmp_path), timeout=300).stdout.split()[-1])
    assert extra < 200, f"a compressed checkpoint of a strided 128 MiB array took {extra} MiB more"


def _resharded_read(tmp_path, **config):
    """A 32 MiB array checkpointed at L4, then read back as a restart on another number of ranks reads a span of
    an old file; (the array, the parsed file, the peak bytes tracemalloc saw during the read)."""
    import tracemalloc

    import numpy as np

    import ftidask
    from ftidask.engine.reshard_files import _read_span, _Scratch
    from ftidask.ftiff.reader import parse_ftiff
    from ftidask.storage.files import open_read

    dirs = dict(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                verbosity=4, **config)
    field = np.arange(2**22, dtype=np.float64)  # 32 MiB: one raw container, or 8 compressed frames
    with ftidask.init(**dirs, keep_last_ckpt=1) as ctx:
        ctx.protect(1, field)
        ctx.checkpoint(1, 4)
    (path,) = (tmp_path / "G").rglob("Ckpt1-Rank0.fti")
    with open_read(path) as fh:
        parsed = parse_ftiff(fh, str(path))
        tracemalloc.start()
        try:
            buf = np.empty(field.nbytes, np.uint8)  # the span's buffer, counted
            _read_span(fh, parsed, 1, 0, buf, _Scratch())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert buf.tobytes() == field.tobytes()
    return field, parsed, peak


def test_resharded_read_of_a_compressed_container_decodes_in_place(tmp_path):
    """A restart on another number of ranks reads the spans of the old files its blocks need: a compressed
    container was decoded to its frames, joined (two copies of the raw container) and copied into the span's
    buffer. It is now decoded into that buffer: the buffer and the stored bytes are what a span costs."""
    pytest.importorskip("numcodecs")
    field, parsed, peak = _resharded_read(tmp_path, compressor="zstd")
    stored = sum(meta.chunksize for _b, _c, meta in parsed.containers())  # compressed: about 4 MiB
    assert peak < field.nbytes + stored + (4 << 20), f"{peak >> 20} MiB to read a 32 MiB span"


def test_resharded_read_of_a_raw_container_reads_in_place(tmp_path):
    """A raw container of the spans a restart on another number of ranks reads was read whole as bytes, hashed,
    then copied into the span's buffer (a 32 MiB span: 96 MiB allocated). It is read into that buffer and hashed
    there (readhash.read_hashed): the buffer is what a span costs."""
    field, _parsed, peak = _resharded_read(tmp_path)
    assert peak < field.nbytes + (4 << 20), f"{peak >> 20} MiB to read a 32 MiB span"


NOISY_IN_USE = PEAK + r"""
import sys, numpy as np, ftidask
root = sys.argv[1]
dirs = dict(ckpt_dir=root + '/L', glbl_dir=root + '/G', meta_dir=root + '/M', verbosity=4, compressor='zstd')
n = 2**24  # 2 x 128 MiB of noise at 2 decimals: zstd stores about a quarter of it
arrays = [np.round(np.random.default_rng(i).standard_normal(n), 2) for i in range(2)]
want = [a.copy() for a in arrays]
ctx = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx.protect(i + 1, a)
ctx.checkpoint(1, 1)
for a in arrays:
    a[:] = -1
ctx2 = ftidask.init(**dirs)
for i, a in enumerate(arrays):
    ctx2.protect(i + 1, a)
extra = peak_of(ctx2.recover)
assert all((a == w).all() for a, w in zip(arrays, want))
fresh = False  # fresh arrays: their pages, moved under them by the recovery, are not extra
print((extra - (sum(a.nbytes for a in arrays) if fresh else 0)) >> 20)
"""


def test_compressed_recovery_in_use_reads_the_stored_bytes_a_piece_at_a_time(tmp_path):
    """After the verification, each compressed container was read whole to be hashed again before it was decoded
    (two at once): as much memory as the stored bytes, which for data that compresses little is most of the array.
    They are now hashed through a ring of buffers, then decoded a frame at a time from the file, as the
    verification does (2 x 128 MiB, 4 to 1: 70 MiB more before, 33 now)."""
    pytest.importorskip("numcodecs")
    extra = int(run_python(NOISY_IN_USE, str(tmp_path), timeout=300).stdout.split()[-1])
    assert extra < 56, f"recovering 2 x 128 MiB compressed into the arrays in use took {extra} MiB more"


NOISY_FRESH = NOISY_IN_USE.replace("for a in arrays:\n    a[:] = -1\n", "arrays = [np.empty(n) for _ in range(2)]\n") \
    .replace("fresh = False", "fresh = True")


def test_compressed_restart_into_fresh_arrays_reads_a_few_frames_at_a_time(tmp_path):
    """A restart into fresh arrays reads, hashes and decodes each container once, into staged pages moved under the
    arrays: each container's stored bytes were read whole first (two or four at once), most of the array for data
    that compresses little. A container in frames is now read a few frames at a time, each frame decoded into the
    staged pages as soon as it is read and hashed (those pages are dropped if the container's hash does not match
    at the end). 2 x 128 MiB, 4 to 1: 63 MiB more before, 8 now."""
    pytest.importorskip("numcodecs")
    extra = int(run_python(NOISY_FRESH, str(tmp_path), timeout=300).stdout.split()[-1])
    assert extra < 32, f"recovering 2 x 128 MiB compressed into fresh arrays took {extra} MiB more"


def test_compressed_recovery_in_use_allocates_per_container_no_more_than_it_reads(tmp_path, monkeypatch):
    """Each compressed container recovered into an array in use is hashed again through read buffers of its own:
    they were a ring of 6 x 2 MiB, allocated and zeroed per container whatever its size (1,000 arrays of 8 KiB:
    12 GiB zeroed, a recovery three times slower). They are no larger than what the container holds."""
    pytest.importorskip("numcodecs")
    import numpy as np

    import ftidask
    from ftidask.ftiff import readahead, verify

    dirs = dict(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                verbosity=4, compressor="zstd")
    arrays = [np.arange(1024, dtype=np.float64) + i for i in range(20)] + [np.arange(2**20, dtype=np.float64)]
    ctx = ftidask.init(**dirs)
    for i, a in enumerate(arrays):
        ctx.protect(i, a)
    ctx.checkpoint(1, 1)
    ctx._close()  # as a run that ends there: the checkpoint stays for the restart
    real, rings = verify.container_problem, []

    def recording(fd, parsed, meta, what, decode, ring=None):
        if not decode:  # the second hash of a recovery into arrays in use (the verification's decodes too)
            rings.append((meta.chunksize, sum(len(b) for b in ring)))
        return real(fd, parsed, meta, what, decode, ring)

    monkeypatch.setattr(verify, "container_problem", recording)
    with ftidask.init(**dirs) as ctx:
        for i, a in enumerate(arrays):
            a[:] = -1.0
            ctx.protect(i, a)
        ctx.recover()
    assert all(np.array_equal(a, np.arange(a.size, dtype=np.float64) + (i if a.size == 1024 else 0))
               for i, a in enumerate(arrays))
    second = [(stored, held) for stored, held in rings if stored < 64 << 10]
    assert len(second) >= 20 and all(held <= stored for stored, held in second), second[:3]
    assert all(held <= readahead.PIECE * readahead.SLOTS for _s, held in rings)


@pytest.mark.slow
def test_dask_differential_l3_of_a_whole_changed_state_keeps_its_delta_out_of_memory(tmp_path):
    """Dask level 7 (benchmarks/bench_memory.py's row: 2 workers of 256 MiB, the third checkpoint, every block
    changed): the write task returned every changed byte's old XOR new as its result, held by the worker until the
    parity task: 274 MiB beyond the state on main. Past ``files.XOR_IN_MEMORY`` the delta goes to a scratch file of
    the worker (the task returns the delta, with its descriptor, to the parity task pinned there): 81 MiB."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("distributed")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_memory.py"), "--child", "dask", "L7-ckpt",
                           "", "--dir", str(tmp_path), "--mib", "256"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    extra = row["extra"] >> 20
    assert extra < 160, f"a Dask level 7 checkpoint of 256 MiB a worker, all changed, took {extra} MiB more"


@pytest.mark.mpi
@pytest.mark.slow
def test_heads_differential_l3_keeps_no_delta_in_memory(tmp_path):
    """Level 7 raised by MPI heads (benchmarks/bench_memory.py's "MPI L7 heads" row: 2 nodes of a head and a rank of
    160 MiB, the third checkpoint with 2/5 of the blocks changed, a delta of 64 MiB a file): each head compared the
    previous checkpoint's file with the new one and kept every block that differed as its XOR, up to half of each
    file of its node: 93 MiB beyond its memory before init on main. It now keeps which blocks differ and reads their
    XOR back from both files a stripe at a time during the exchange: 29 MiB (40 at 256 MiB a rank), whatever changed."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mpi_util import mpiexec, need_mpi

    if any(mark.name == "skipif" and mark.args and mark.args[0] for mark in need_mpi()):
        pytest.skip("needs mpi4py and mpiexec")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), BENCH_VERBOSITY="2")
    proc = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(root / "benchmarks" / "bench_memory.py"),
                           "--mpi-child", "L7H40-ckpt", "--dir", str(tmp_path), "--mib", "160"], capture_output=True,
                          text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert log.count("L3: parity of rank 0 updated from the group's deltas") == 2, log[-3000:]  # checkpoints 2, 3
    row = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    extra = row["extra"] >> 20
    assert extra < 48, f"a head raising level 7 with a delta of 64 MiB a file took {extra} MiB more"
