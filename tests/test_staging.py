"""Staging (FTI_GetStageDir / FTI_SendFile / FTI_GetStageStatus) in one process: thread and process movers."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

import ftidask
from ftidask import SI_ACTV, SI_FAIL, SI_NINI, SI_PEND, SI_SCES, FTIError, StagingError
from ftidask.staging import process as staging_process
from ftidask.staging.process import ProcessMover
from ftidask.staging.stager import Stager, ThreadMover
from ftidask.storage.files import find_paths

sys.path.insert(0, str(Path(__file__).parent))
import slowcopy  # noqa: E402

MiB = 1 << 20


def make_ctx(tmp_path: Path, **kw):
    kw.setdefault("enable_staging", 1)
    return ftidask.init(ckpt_dir=tmp_path / "local", glbl_dir=tmp_path / "global", meta_dir=tmp_path / "meta",
                        **kw)


def make_stager(tmp_path: Path, mover, **kw) -> Stager:
    stage = tmp_path / "local" / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    (tmp_path / "global").mkdir(exist_ok=True)
    return Stager(stage, tmp_path / "global", mover, **kw)


def write_random(path: Path, size: int, seed: int = 0) -> str:
    """Write ``size`` random bytes (in pieces, so that 256 MiB is never in memory twice); their hash."""
    hasher = xxhash.xxh3_128()
    with open(path, "wb") as fh:
        left = size
        while left:
            block = os.urandom(min(left, 16 * MiB))
            fh.write(block)
            hasher.update(block)
            left -= len(block)
    return hasher.hexdigest()


def file_hash(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 * MiB):
            hasher.update(chunk)
    return hasher.hexdigest()


def leftovers(directory: Path) -> list[str]:
    """Temporary files of transfers left in ``directory`` (there must be none)."""
    return sorted(p.name for p in find_paths(directory, "*") if "ftidask-stage" in p.name)


def poll_until_final(ctx_or_table, req_id: int, timeout: float = 60.0) -> list[int]:
    """FTI's polling loop: the distinct states seen, up to and including the final one."""
    query = ctx_or_table.stage_status if hasattr(ctx_or_table, "stage_status") else ctx_or_table.query
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = query(req_id)
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in (SI_SCES, SI_FAIL):
            return seen
        time.sleep(0.001)
    raise AssertionError(f"request {req_id} not final after {timeout} s: {seen}")


# --- API and states ------------------------------------------------------------------------------


def test_disabled_staging_raises(tmp_path):
    ctx = make_ctx(tmp_path, enable_staging=0)
    for call in (ctx.stage_dir, lambda: ctx.send_file("a", "b"), lambda: ctx.stage_status(1)):
        with pytest.raises(FTIError, match="enable_staging = 1"):
            call()
    ctx.finalize()


def test_stage_dir_is_node_local_and_per_rank(tmp_path):
    ctx = make_ctx(tmp_path)
    d = ctx.stage_dir()
    assert d.is_dir()
    assert d == tmp_path / "local" / "stage" / ctx.exec_id / "node0" / "rank0"
    ctx.finalize()


def test_constants_match_fti():
    assert (SI_FAIL, SI_SCES, SI_ACTV, SI_PEND, SI_NINI) == (-2, 0, 1, 2, 3)
    assert ftidask.FTI_SI_PEND == SI_PEND and ftidask.FTI_SI_NINI == SI_NINI


@pytest.mark.parametrize("mover", ["thread", "process"])
def test_state_sequence_matches_fti(tmp_path, mover, monkeypatch):
    # A slowed mover keeps request 1 active until it is seen active, request 2 pending behind it (the gate: however
    # long this loop takes to see it on a loaded machine).
    gate = tmp_path / "gate"
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    m = ThreadMover() if mover == "thread" else ProcessMover()
    stager = make_stager(tmp_path, m)
    big, small = stager.stage_dir / "big", stager.stage_dir / "small"
    h_big = write_random(big, 32 * MiB)
    small.write_bytes(b"hello")
    r1 = stager.send(big, "big")
    r2 = stager.send(small, "small")
    seqs: dict[int, list[int]] = {r1: [], r2: []}
    while any(not s or s[-1] not in (SI_SCES, SI_FAIL) for s in seqs.values()):
        for req, seq in seqs.items():
            if not seq or seq[-1] not in (SI_SCES, SI_FAIL):
                state = stager.table.query(req)
                if not seq or seq[-1] != state:
                    seq.append(state)
        if SI_ACTV in seqs[r1] and not gate.exists():
            gate.touch()
        time.sleep(0.001)
    seq1, seq2 = seqs[r1], seqs[r2]
    assert seq1[-2:] == [SI_ACTV, SI_SCES] and set(seq1) <= {SI_PEND, SI_ACTV, SI_SCES}
    assert seq2 == [SI_PEND, SI_ACTV, SI_SCES] or seq2 == [SI_PEND, SI_SCES]
    # A final state is returned once; then the id is unknown.
    assert stager.table.query(r1) == SI_NINI and stager.table.query(r2) == SI_NINI
    assert stager.table.query(12345) == SI_NINI
    assert file_hash(tmp_path / "global" / "big") == h_big
    assert (tmp_path / "global" / "small").read_bytes() == b"hello"
    assert not big.exists() and not small.exists()
    assert stager.close(10) == []


@pytest.mark.parametrize("mover", ["thread", "process"])
def test_many_small_files(tmp_path, mover):
    ctx = make_ctx(tmp_path, stage_mover=mover)
    stage = ctx.stage_dir()
    rng = __import__("random").Random(7)
    expected, ids = {}, {}
    for i in range(150):
        data = os.urandom(rng.choice([0, 1, 100, 4096, 65536, 200_000]))
        name = f"out{i % 5}/file{i}.bin"  # several destination directories, created on demand
        (stage / f"file{i}.bin").write_bytes(data)
        expected[name] = data
        ids[name] = ctx.send_file(stage / f"file{i}.bin", name)
    states = ctx.wait_staged()
    assert set(states) == set(ids.values()) and set(states.values()) == {SI_SCES}
    for name, req in ids.items():
        assert ctx.stage_status(req) == SI_SCES and ctx.stage_status(req) == SI_NINI
        assert (tmp_path / "global" / name).read_bytes() == expected[name]
    assert list(stage.iterdir()) == []  # every local file removed after its verified copy
    assert leftovers(tmp_path / "global") == []
    ctx.finalize()


@pytest.mark.slow
@pytest.mark.parametrize("mover", ["thread", "process"])
def test_256_mib_file(tmp_path, mover):
    ctx = make_ctx(tmp_path, stage_mover=mover)
    src = ctx.stage_dir() / "big.dat"
    digest = write_random(src, 256 * MiB, seed=3)
    req = ctx.send_file(src, "results/big.dat")
    seq = poll_until_final(ctx, req, timeout=300)
    assert seq[-1] == SI_SCES, ctx.stage_info(req)
    assert ctx.stage_status(req) == SI_NINI
    dst = tmp_path / "global" / "results" / "big.dat"
    assert dst.stat().st_size == 256 * MiB and file_hash(dst) == digest
    assert not src.exists()
    ctx.finalize()


def test_wait_staged_one_request_and_info(tmp_path):
    ctx = make_ctx(tmp_path)
    src = ctx.stage_dir() / "a"
    src.write_bytes(b"abc")
    req = ctx.send_file(src, "dir/")  # a trailing slash: into that directory, under the file's name
    assert ctx.wait_staged(req, timeout=30) == SI_SCES
    info = ctx.stage_info(req)
    assert info.state == SI_SCES and info.request.dst == os.fspath((tmp_path / "global" / "dir" / "a").resolve())
    assert ctx.stage_status(req) == SI_SCES  # waiting did not consume the final state
    assert ctx.stage_status(req) == SI_NINI and ctx.wait_staged(req) == SI_NINI  # consumed, as in FTI
    assert ctx.stage_info(req).state == SI_SCES  # but still told (the README reads its reason after polling)
    ctx.finalize()


# --- bad input: errors at the call ---------------------------------------------------------------


def test_bad_requests_raise_at_the_call(tmp_path):
    ctx = make_ctx(tmp_path)
    stage = ctx.stage_dir()
    (stage / "ok").write_bytes(b"1")
    outside = tmp_path / "elsewhere.txt"
    outside.write_bytes(b"x")
    with pytest.raises(StagingError, match="not in the stage directory"):
        ctx.send_file(outside, "x")
    (stage / "link").symlink_to(outside)  # a symlink in the stage dir that leads out of it
    with pytest.raises(StagingError, match="not in the stage directory"):
        ctx.send_file(stage / "link", "x")
    with pytest.raises(StagingError, match="does not exist"):
        ctx.send_file(stage / "missing", "x")
    (stage / "sub").mkdir()
    with pytest.raises(StagingError, match="not a regular file"):
        ctx.send_file(stage / "sub", "x")
    with pytest.raises(StagingError, match="not a regular file"):  # it said "not in the stage directory"
        ctx.send_file(stage, "x")
    with pytest.raises(StagingError, match="outside glbl_dir"):
        ctx.send_file(stage / "ok", tmp_path / "not_global" / "ok")
    with pytest.raises(StagingError, match="outside glbl_dir"):
        ctx.send_file(stage / "ok", "../escape")
    (tmp_path / "global" / "taken").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "global" / "taken").write_bytes(b"keep me")
    with pytest.raises(StagingError, match="already exists"):
        ctx.send_file(stage / "ok", "taken")
    assert (tmp_path / "global" / "taken").read_bytes() == b"keep me"
    assert (stage / "ok").exists()  # nothing was queued, nothing was removed
    ctx.finalize()


@pytest.mark.parametrize("mover", ["thread", "process"])
def test_odd_paths_and_timeouts_are_refused_at_the_call_or_served(tmp_path, mover):
    """A NUL in a path was accepted by send_file; the mover thread then died on it (a raw ValueError), and every
    later request stayed pending (wait_staged without a timeout hung; finalize waited stage_timeout). A timeout of
    inf raised a raw OverflowError. A destination name of 230 bytes, which the file system takes, failed: the
    temporary name added 33 bytes. Refused at the call, no limit, and staged now."""
    ctx = make_ctx(tmp_path, stage_mover=mover)
    stage = ctx.stage_dir()
    (stage / "a").write_bytes(b"abc")
    for local, remote in ((stage / "a", "bad\0name"), (f"{stage}/a\0", "x"), (os.fsencode(stage / "a"), b"o\0")):
        with pytest.raises(StagingError, match="NUL"):
            ctx.send_file(local, remote)
    with pytest.raises(StagingError, match="nan"):
        ctx.wait_staged(timeout=float("nan"))
    long = "n" * 230
    req = ctx.send_file(os.fsencode(stage / "a"), long)  # bytes paths are paths too
    assert ctx.wait_staged(req, timeout=float("inf")) == SI_SCES, ctx.stage_info(req).reason
    assert ctx.wait_staged(timeout=1e300) == {req: SI_SCES}
    (stage / "b").write_bytes(b"def")
    req = ctx.send_file(stage / "b", "é" * 120)  # 240 bytes of a 2-byte character: the temporary name cut in one
    assert ctx.wait_staged(req, timeout=60) == SI_SCES, ctx.stage_info(req).reason
    ctx.finalize()
    assert (tmp_path / "global" / long).read_bytes() == b"abc"
    assert (tmp_path / "global" / ("é" * 120)).read_bytes() == b"def"
    assert not [p for p in (tmp_path / "global").iterdir() if p.name.startswith(".")]


def test_two_pending_requests_to_one_destination(tmp_path, monkeypatch):
    gate = tmp_path / "gate"  # the first copy is still running when the second request comes, whatever the load
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover())
    a, b = stager.stage_dir / "a", stager.stage_dir / "b"
    write_random(a, 24 * MiB)
    b.write_bytes(b"b")
    ra = stager.send(a, "same")
    with pytest.raises(StagingError, match="another pending request"):
        stager.send(b, "same")
    gate.touch()
    assert stager.wait(ra, 60) == SI_SCES
    stager.close(10)


def test_outside_glbl_dir_allowed_by_config(tmp_path):
    ctx = make_ctx(tmp_path, stage_allow_outside=1)
    src = ctx.stage_dir() / "f"
    src.write_bytes(b"out there")
    req = ctx.send_file(src, tmp_path / "archive" / "f")
    assert ctx.wait_staged(req, 30) == SI_SCES
    assert (tmp_path / "archive" / "f").read_bytes() == b"out there"
    ctx.finalize()


# --- failures during the transfer ----------------------------------------------------------------


def test_destination_parent_is_a_file_raises(tmp_path):
    ctx = make_ctx(tmp_path)
    stage = ctx.stage_dir()
    (tmp_path / "global").mkdir(exist_ok=True)
    (tmp_path / "global" / "blocker").write_bytes(b"a file, not a directory")
    (stage / "f").write_bytes(b"data")
    with pytest.raises(StagingError, match="blocker is a file, not a directory"):
        ctx.send_file(stage / "f", "blocker/sub/f")
    ctx.finalize()


def test_destination_blocked_during_transfer_fails_with_reason(tmp_path, monkeypatch):
    # the first request stays busy while the second one's path is blocked (until the gate opens: whatever the load)
    gate = tmp_path / "gate"
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    ctx = make_ctx(tmp_path)
    stage = ctx.stage_dir()
    write_random(stage / "first", 24 * MiB)
    (stage / "f").write_bytes(b"data")
    r1 = ctx.send_file(stage / "first", "first")
    r2 = ctx.send_file(stage / "f", "later/sub/f")
    (tmp_path / "global").mkdir(exist_ok=True)
    (tmp_path / "global" / "later").write_bytes(b"")  # the application puts a file where a directory goes
    gate.touch()
    assert poll_until_final(ctx, r2)[-1] == SI_FAIL
    assert ctx.wait_staged(r1, 60) == SI_SCES
    assert (stage / "f").read_bytes() == b"data"  # a failed request keeps the local file
    assert leftovers(tmp_path / "global") == []
    (stage / "g").write_bytes(b"later")
    req = ctx.send_file(stage / "g", "fine/g")  # later requests still work
    assert ctx.wait_staged(req, 30) == SI_SCES
    ctx.finalize()


def test_failure_reason_is_reported(tmp_path, monkeypatch):
    gate = tmp_path / "gate"  # the first copy runs until the second request's path is blocked, whatever the load
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover())
    write_random(stager.stage_dir / "first", 24 * MiB)
    (stager.stage_dir / "f").write_bytes(b"data")
    stager.send(stager.stage_dir / "first", "first")
    req = stager.send(stager.stage_dir / "f", "blocker/f")
    (tmp_path / "global" / "blocker").write_bytes(b"")
    gate.touch()
    assert stager.wait(req, 30) == SI_FAIL
    assert "not a directory (ENOTDIR)" in stager.table.info(req).reason
    assert stager.table.query(req) == SI_FAIL  # FTI's loop consumed the final state: the reason is still told
    assert "not a directory (ENOTDIR)" in stager.table.info(req).reason
    stager.close(30)


def test_final_states_returned_are_told_for_the_last_requests_only(tmp_path, monkeypatch):
    from ftidask.staging import stager as stager_module

    monkeypatch.setattr(stager_module, "HISTORY", 2)
    ctx = make_ctx(tmp_path)
    reqs = []
    for name in "abc":
        (ctx.stage_dir() / name).write_bytes(name.encode())
        reqs.append(ctx.send_file(ctx.stage_dir() / name, name))
        assert poll_until_final(ctx, reqs[-1])[-1] == SI_SCES
    assert ctx.stage_info(reqs[0]) is None  # the history is bounded: a run may send millions of files
    assert [ctx.stage_info(r).state for r in reqs[1:]] == [SI_SCES, SI_SCES]
    ctx.finalize()


def test_file_larger_than_rlimit_fsize(tmp_path, monkeypatch):
    # The mover starts under RLIMIT_FSIZE = 1 MiB (as under a batch system's limit).
    real_popen = subprocess.Popen

    def popen_with_limit(*args, **kwargs):
        kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 * MiB, 1 * MiB))
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(staging_process.subprocess, "Popen", popen_with_limit)
    stager = make_stager(tmp_path, ProcessMover())
    big, small = stager.stage_dir / "big", stager.stage_dir / "small"
    write_random(big, 3 * MiB)
    small.write_bytes(b"s" * 1000)
    r_big = stager.send(big, "big")
    r_small = stager.send(small, "small")
    assert stager.wait(r_big, 60) == SI_FAIL
    assert "File too large (EFBIG)" in stager.table.info(r_big).reason
    assert stager.wait(r_small, 60) == SI_SCES  # the same mover keeps serving
    # Checked once both are settled: the small file's own temporary exists while it is moved.
    assert not (tmp_path / "global" / "big").exists() and leftovers(tmp_path / "global") == []
    assert big.stat().st_size == 3 * MiB
    assert (tmp_path / "global" / "small").read_bytes() == b"s" * 1000
    assert stager.mover.restarts == 0
    stager.close(10)


@pytest.fixture
def full_fs(tmp_path):
    """A 1 MiB tmpfs as the destination (needs root); unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", os.fspath(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", os.fspath(mnt)], check=False)


@pytest.mark.parametrize("mover", ["thread", "process"])
def test_disk_full(tmp_path, full_fs, mover):
    ctx = make_ctx(tmp_path, stage_allow_outside=1, stage_mover=mover)
    stage = ctx.stage_dir()
    write_random(stage / "big", 3 * MiB)
    req = ctx.send_file(stage / "big", full_fs / "big")
    assert poll_until_final(ctx, req)[-1] == SI_FAIL
    assert list(full_fs.iterdir()) == []  # neither the file nor its temporary
    assert (stage / "big").stat().st_size == 3 * MiB
    (stage / "small").write_bytes(b"fits")
    req = ctx.send_file(stage / "small", full_fs / "small")
    assert ctx.wait_staged(req, 30) == SI_SCES
    assert (full_fs / "small").read_bytes() == b"fits"
    ctx.finalize()


def test_disk_full_reason(tmp_path, full_fs):
    stager = make_stager(tmp_path, ThreadMover(), allow_outside=True)
    write_random(stager.stage_dir / "big", 2 * MiB)
    req = stager.send(stager.stage_dir / "big", full_fs / "big")
    assert stager.wait(req, 30) == SI_FAIL
    assert "No space left on device (ENOSPC)" in stager.table.info(req).reason
    stager.close(5)


def test_source_modified_during_transfer_fails(tmp_path, monkeypatch):
    gate = tmp_path / "gate"  # the copy cannot end before the change, whatever the load
    slowcopy.slow_movers(0.1, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover())
    src = stager.stage_dir / "f"
    write_random(src, 32 * MiB)
    req = stager.send(src, "f")
    while stager.table.info(req).state == SI_PEND:
        time.sleep(0.001)
    time.sleep(0.05)  # past the file system's timestamp granularity: the change shows in mtime
    with open(src, "r+b") as fh:  # the application rewrites a file it already handed over
        fh.seek(MiB)
        fh.write(b"changed")
    gate.touch()
    assert stager.wait(req, 60) == SI_FAIL
    assert "modified during the transfer" in stager.table.info(req).reason
    assert not (tmp_path / "global" / "f").exists() and leftovers(tmp_path / "global") == []
    stager.close(5)



@pytest.mark.parametrize("mover", ["thread", "process"])
def test_a_source_replaced_by_a_fifo_fails_and_the_requests_behind_it_go_on(tmp_path, mover, monkeypatch):
    """A staged file replaced by a FIFO after send_file: the mover's open() waited for a writer for ever, the requests
    queued behind it with it (and an MPI head's finalize). Now it fails as no regular file, and the next is copied."""
    gate = tmp_path / "gate"  # the FIFO is in place before the mover comes to it
    slowcopy.slow_movers(0.0, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover() if mover == "thread" else ProcessMover())
    first, swapped, last = (stager.stage_dir / name for name in ("first", "swapped", "last"))
    first.write_bytes(b"a" * MiB)
    swapped.write_bytes(b"b" * 1000)
    last.write_bytes(b"c" * 1000)
    ids = [stager.send(path, path.name) for path in (first, swapped, last)]
    swapped.unlink()
    os.mkfifo(swapped)
    gate.touch()
    assert [stager.wait(req, 60) for req in ids] == [SI_SCES, SI_FAIL, SI_SCES]
    assert (tmp_path / "global" / "last").read_bytes() == b"c" * 1000
    assert not (tmp_path / "global" / "swapped").exists() and leftovers(tmp_path / "global") == []
    (failed,) = stager.close(10)  # reported again as it closes
    assert failed.request.id == ids[1] and failed.reason.endswith("swapped is no longer a regular file")


# --- the mover killed ---------------------------------------------------------------------------


def test_mover_killed_mid_transfer(tmp_path, monkeypatch):
    gate = tmp_path / "gate"  # the copy cannot end before the kill, whatever the load
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    mover = ProcessMover()
    stager = make_stager(tmp_path, mover)
    big, queued = stager.stage_dir / "big", stager.stage_dir / "queued"
    digest = write_random(big, 64 * MiB)
    queued.write_bytes(b"q")
    r_big = stager.send(big, "big")
    r_queued = stager.send(queued, "queued")
    while stager.table.info(r_big).state == SI_PEND:
        time.sleep(0.001)
    # The temporary file exists at the destination while the copy runs: it is what must not survive.
    deadline = time.monotonic() + 30
    while not leftovers(tmp_path / "global") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert leftovers(tmp_path / "global")
    os.kill(mover.pid, signal.SIGKILL)
    gate.touch()  # (for the mover started next)
    assert stager.wait(r_big, 30) == SI_FAIL and stager.wait(r_queued, 30) == SI_FAIL
    for req in (r_big, r_queued):
        assert stager.table.info(req).reason == "mover died (killed by SIGKILL)"
    assert sorted(p.name for p in (tmp_path / "global").iterdir()) == []
    assert big.exists() and queued.exists()  # the local files are still there to resend
    # Later requests work: a new mover starts.
    r_again = stager.send(big, "big")
    assert stager.wait(r_again, 120) == SI_SCES
    assert file_hash(tmp_path / "global" / "big") == digest and mover.restarts == 1
    stager.close(10)


def test_head_process_killed_through_context(tmp_path):
    ctx = make_ctx(tmp_path, head=1)  # one process with head = 1: a mover process plays FTI's head
    stage = ctx.stage_dir()
    (stage / "a").write_bytes(b"a")
    req = ctx.send_file(stage / "a", "a")
    assert ctx.wait_staged(req, 60) == SI_SCES
    mover = ctx._stager.mover
    assert isinstance(mover, ProcessMover) and mover.pid != os.getpid()
    os.kill(mover.pid, signal.SIGKILL)
    (stage / "b").write_bytes(b"b")
    req_b = ctx.send_file(stage / "b", "b")  # sent to a dead mover, or to its replacement
    state = ctx.wait_staged(req_b, 60)
    if state == SI_FAIL:
        assert "mover died" in ctx.stage_info(req_b).reason
        assert ctx.stage_status(req_b) == SI_FAIL  # read: finalize has nothing left to report
        req_b = ctx.send_file(stage / "b", "b")
        state = ctx.wait_staged(req_b, 60)
    assert state == SI_SCES and (tmp_path / "global" / "b").read_bytes() == b"b"
    ctx.finalize()


# --- finalize ----------------------------------------------------------------------------------


def test_finalize_waits_for_pending_requests(tmp_path):
    ctx = make_ctx(tmp_path)
    stage = ctx.stage_dir()
    for i in range(20):
        (stage / f"f{i}").write_bytes(os.urandom(300_000))
        ctx.send_file(stage / f"f{i}", f"f{i}")
    ctx.finalize()
    assert sorted(p.name for p in (tmp_path / "global").iterdir()) == sorted(f"f{i}" for i in range(20))
    assert not stage.exists()  # every file moved, and finalize prunes the empty stage directory


def test_finalize_reports_failures_after_finishing(tmp_path, monkeypatch):
    gate = tmp_path / "gate"  # the first copy runs until the second request's path is blocked, whatever the load
    slowcopy.slow_movers(0, monkeypatch.setattr, gate)
    ctx = make_ctx(tmp_path)
    stage = ctx.stage_dir()
    write_random(stage / "good", 16 * MiB)
    (stage / "bad").write_bytes(b"x")
    ctx.send_file(stage / "good", "good")
    ctx.send_file(stage / "bad", "blocker/bad")
    (tmp_path / "global").mkdir(exist_ok=True)
    (tmp_path / "global" / "blocker").write_bytes(b"")  # blocks the second request while the first runs
    gate.touch()
    with pytest.raises(StagingError, match=r"1 staging request\(s\) failed: .*bad.*ENOTDIR"):
        ctx.finalize()
    assert ctx._closed  # the rest of finalize ran
    assert (tmp_path / "global" / "good").stat().st_size == 16 * MiB
    ctx.finalize()  # a second call is a no-op


def test_finalize_timeout_cancels_cleanly(tmp_path, monkeypatch):
    slowcopy.slow_movers(0.2, monkeypatch.setattr)
    stager = make_stager(tmp_path, ThreadMover())
    srcs = [stager.stage_dir / f"f{i}" for i in range(3)]
    for src in srcs:
        write_random(src, 16 * MiB)
    for i, src in enumerate(srcs):
        stager.send(src, f"f{i}")
    failed = stager.close(0.1)
    assert len(failed) == 3 and all("stage_timeout" in f.reason for f in failed)
    assert list((tmp_path / "global").iterdir()) == []
    assert all(s.exists() for s in srcs)


def test_process_mover_finalize_timeout(tmp_path, monkeypatch):
    slowcopy.slow_movers(0.2, monkeypatch.setattr)
    stager = make_stager(tmp_path, ProcessMover())
    src = stager.stage_dir / "f"
    write_random(src, 32 * MiB)
    req = stager.send(src, "f")
    failed = stager.close(0.3)
    assert [f.request.id for f in failed] == [req] and "stage_timeout" in failed[0].reason
    assert list((tmp_path / "global").iterdir()) == [] and src.exists()


def test_send_file_does_not_wait_for_the_copy(tmp_path, monkeypatch):
    # Not a timing assertion: the request is still open when send_file returns (the mover held at the gate).
    gate = tmp_path / "gate"
    slowcopy.slow_movers(0.05, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover())
    src = stager.stage_dir / "f"
    write_random(src, 32 * MiB)
    req = stager.send(src, "f")
    assert stager.table.info(req).state in (SI_PEND, SI_ACTV)
    gate.touch()
    assert stager.wait(req, 60) == SI_SCES
    stager.close(5)


def test_context_manager_error_exit_still_finishes_transfers(tmp_path):
    with pytest.raises(RuntimeError, match="application error"):
        with make_ctx(tmp_path) as ctx:
            stage = ctx.stage_dir()
            (stage / "result").write_bytes(b"keep this")
            ctx.send_file(stage / "result", "result")
            raise RuntimeError("application error")
    assert (tmp_path / "global" / "result").read_bytes() == b"keep this"


def test_first_send_file_does_not_start_the_mover(tmp_path):
    ctx = make_ctx(tmp_path, head=1)
    stage = ctx.stage_dir()  # the mover process starts here
    mover = ctx._stager.mover
    pid = mover.pid
    assert pid is not None
    (stage / "f").write_bytes(b"f")
    req = ctx.send_file(stage / "f", "f")
    assert mover.pid == pid and mover.restarts == 0
    assert ctx.wait_staged(req, 60) == SI_SCES
    ctx.finalize()


EXIT_SCRIPT = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import slowcopy
slowcopy.slow_movers(0.3)   # a slow transfer (over 1 s), still running at exit on a loaded machine too
import ftidask
root = Path(sys.argv[1])
ctx = ftidask.init(ckpt_dir=root / "local", glbl_dir=root / "global", meta_dir=root / "meta",
                   enable_staging=1, stage_mover=sys.argv[2], verbosity=4)
stage = ctx.stage_dir()
with open(stage / "big", "wb") as fh:
    for _ in range(4):
        fh.write(os.urandom(8 << 20))
req = ctx.send_file(stage / "big", "big")
while not any("ftidask-stage" in p.name for p in (root / "global").iterdir()):
    time.sleep(0.001)
print("exiting while active", flush=True)
"""


@pytest.mark.parametrize("mover", ["thread", "process"])
def test_exit_without_finalize_leaves_nothing_half_written(tmp_path, mover):
    (tmp_path / "global").mkdir()
    script = tmp_path / "app.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([__import__("sys").executable, os.fspath(script), os.fspath(tmp_path), mover,
                           os.fspath(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "exiting while active" in proc.stdout, proc.stderr
    assert list((tmp_path / "global").iterdir()) == []
    assert [p.name for p in find_paths(tmp_path / "local" / "stage", "big")] == ["big"]  # the local file is kept


def test_a_transfer_note_naming_a_file_outside_glbl_dir_removes_nothing(tmp_path):
    """The restart removes the temporary files its notes name (a mover killed mid-copy): a note planted (or
    damaged) to name a file of the same pattern outside glbl_dir, where no transfer of this run writes, left that
    file removed. Only a file under glbl_dir is removed now (anywhere with stage_allow_outside = 1)."""
    import json

    import ftidask

    name = ".frame.ftidask-stage-0123456789ab-1.tmp"
    inside, outside = tmp_path / "Global" / "out" / name, tmp_path / "elsewhere" / name
    for path in (inside, outside):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    notes = tmp_path / "Local" / "stage" / "run1" / "node0" / ".rank0-transfers"
    dirs = {"exec_id": "run1", "ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "enable_staging": 1, "stage_mover": "thread", "verbosity": 4}
    for allow_outside in (0, 1):
        notes.mkdir(parents=True, exist_ok=True)
        (notes / name).write_text(json.dumps({"tmp": str(outside)}))
        ftidask.init(**dirs, stage_allow_outside=allow_outside).finalize()
        assert outside.exists() != bool(allow_outside)
        assert not (notes / name).exists()  # the note goes either way
    top = tmp_path / "Global" / name  # a destination right in glbl_dir (send_file(src, "name"))
    top.write_bytes(b"x")
    for path in (inside, top):
        notes.mkdir(parents=True, exist_ok=True)
        (notes / name).write_text(json.dumps({"tmp": str(path)}))
        ftidask.init(**dirs).finalize()
        assert not path.exists()


def test_a_notes_directory_planted_as_a_link_empties_nothing_outside(tmp_path):
    """The restart sweeps its transfer notes (and `ftidask clean` a dead run's): a link planted at the notes
    directory's name had every entry of its target removed, subdirectories too. The notes directory is opened
    without following a link, and only names of notes are removed from it."""
    import ftidask
    from ftidask.tools.cli import main

    victim = tmp_path / "victim"
    (victim / "subdir").mkdir(parents=True)
    (victim / "keep.txt").write_text("precious")
    (victim / "subdir" / "data.txt").write_text("precious")
    notes = tmp_path / "Local" / "stage" / "run1" / "node0" / ".rank0-transfers"
    dirs = {"exec_id": "run1", "ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "enable_staging": 1, "stage_mover": "thread"}
    notes.parent.mkdir(parents=True)
    notes.symlink_to(victim)
    ftidask.init(**dirs).finalize()
    assert main(["clean", str(tmp_path), "--yes"]) == 0
    assert sorted(p.name for p in victim.rglob("*")) == ["data.txt", "keep.txt", "subdir"]
    notes.parent.mkdir(parents=True, exist_ok=True)
    notes.unlink(missing_ok=True)
    notes.mkdir()
    (notes / "not-a-note").write_text("x")  # a name no note has: none of ftidask's
    ftidask.init(**dirs).finalize()
    assert (notes / "not-a-note").read_text() == "x"
