import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY_LIST = Path(__file__).resolve().parent / "heavy_variants.txt"
CAMPAIGN_LIST = Path(__file__).resolve().parent / "campaign_only.txt"


# --- Hypothesis: the same examples on every run ------------------------------------------------------------
#
# CI runs on a fresh clone without any of the variables by which Hypothesis recognises a CI machine (its own "ci"
# profile), so each run drew new random examples and a rare one could fail one run in many, and nobody could rerun it.
# Here every run draws the same examples (derandomize: from each test's name), keeps no example database between runs
# (a fresh clone has none), and no health check or deadline depends on the machine's speed (a loaded 2-core machine).
# HYPOTHESIS_PROFILE=explore draws new examples (and keeps a database) to look for new failures.

def _hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the test extras are not installed: the tests that need it skip or fail on their own
        return
    settings.register_profile("ftidask", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ftidask"))


_hypothesis_profiles()


def heavy_variants(listed: Path = HEAVY_LIST) -> set[str]:
    """The node ids of tests/heavy_variants.txt: heavier variants run with the slow tests (``listed``:
    tests/campaign_only.txt, the heaviest slow ones, run with the campaigns)."""
    lines = listed.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    heavy, campaign_only = heavy_variants(), heavy_variants(CAMPAIGN_LIST)
    for item in items:
        if item.nodeid in heavy:
            item.add_marker(pytest.mark.slow)
        if item.nodeid in campaign_only:
            item.add_marker(pytest.mark.campaign)
        if "dask_client" in getattr(item, "fixturenames", ()):  # a Dask cluster: -m "not dask" leaves it out
            item.add_marker(pytest.mark.dask)
    # The campaigns' whole seed matrices run only when asked by name (-m campaign), never with -m slow (CI's budget).
    if "campaign" not in (config.option.markexpr or ""):
        skipped = [item for item in items if item.get_closest_marker("campaign") is not None]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if item.get_closest_marker("campaign") is None]


# --- The "ftidask" logger: each test starts as a fresh process would ------------------------------------------
#
# Every init() with an explicit verbosity sets the "ftidask" logger's level for the whole process, and one with the
# default verbosity keeps the level set before (api/logsetup.py): a test that reads caplog then saw, or missed, its
# lines by the verbosity of whichever test ran last (test_run_isolation's current_exec_id warnings were lost after
# any test of verbosity 4). After each test the logger's level, handlers and propagation are put back.

@pytest.fixture(autouse=True)
def _ftidask_logger_restored():
    import logging

    from ftidask.api import logsetup

    logger = logging.getLogger("ftidask")
    saved = logger.level, list(logger.handlers), logger.propagate, logger.disabled, logsetup._rank
    yield
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate, logger.disabled, logsetup._rank = saved[2], saved[3], saved[4]


# --- MPICH's shared-memory segments of killed jobs ----------------------------------------------------
#
# A rank SIGKILLed before its node's ranks have attached leaves MPICH's segment (/dev/shm/mpich_shm_*, 4-17 MiB
# of RAM each) for ever; the fault tests kill hundreds. After each test, the segments it left that no process
# has open or mapped are removed, so a whole run does not hold gigabytes of the machine's memory.

_SHM = Path("/dev/shm")


def _mpich_segments() -> set[str]:
    try:
        return {name for name in os.listdir(_SHM) if name.startswith("mpich_shm_")}
    except OSError:
        return set()


def _in_use(paths: set[str]) -> set[str]:
    """The paths some process has open or mapped (/proc/*/fd and /proc/*/maps)."""
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            used.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return used & paths


@pytest.fixture(autouse=True)
def _mpich_shm_swept():
    before = _mpich_segments()
    yield
    left = {str(_SHM / name) for name in _mpich_segments() - before}
    for path in left - _in_use(left) if left else ():
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture
def folder(tmp_path):
    """An empty directory holding a copy of examples/config.fti (README: ``cp examples/config.fti .``)."""
    shutil.copy(ROOT / "examples" / "config.fti", tmp_path / "config.fti")
    return tmp_path


@pytest.fixture
def dirs(tmp_path):
    """Config overrides that put a run's directories under tmp_path."""
    return {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 3}


def run_python(code: str, *args: str, timeout: float = 120, check: bool = True, **kw):
    """Run ``code`` in a fresh interpreter with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# --- One LocalCluster shared by the Dask tests ------------------------------------------------------
#
# Starting a LocalCluster of worker processes costs about 1.3 s, closing it about 1 s: more than most
# Dask tests. The tests that ask for the ``dask_client`` fixture share one cluster of worker processes
# (of their module's NWORKERS), each test with a client of its own, and the cluster is kept for the next
# test only when nothing of this one can leak into it. After each test:
#
# * the cluster is *restored*: every worker the test killed (SIGKILL) has been restarted, fresh, by its
#   nanny; the fixture waits until the cluster has its NWORKERS workers again, each one answering (the
#   restarted ones under a new address and pid);
# * the test's client is closed, so the scheduler forgets every task of the test (an erred future
#   keeps itself alive in its client: its exception's traceback holds it), and the fixture waits
#   until the scheduler holds no task;
# * the cluster is closed instead (the next test starts a new one) when the test failed, when a worker
#   still carries a test seam (a crash point or a slowed copy: ``crashpoints.seams``), or when the
#   workers or the scheduler are not back in time.
#
# Each test has its own directories (``dirs``, ``tmp_path``) and its own run (a new exec_id), so what
# stays in a worker process from one test to the next (its background removal thread, its rebuild
# locks) concerns other paths only. It changes timings though: a worker whose removal thread an earlier
# test started is quicker to its first deletion than a fresh one, so a test must not rely on which worker
# wins a race (every worker renames every node directory it sees, and here they all see the same disk).

_WORKER_WAIT = 60  # seconds a test waits for its cluster's workers to start
_RESTART_WAIT = 30  # seconds the fixture waits for killed workers to be restarted


class DaskClusters:
    """At most one live LocalCluster of worker processes, shared between tests."""

    def __init__(self) -> None:
        self.cluster = None
        self.nworkers = 0

    def client(self, nworkers: int):
        """A new client of a cluster of ``nworkers`` workers (the live one, or a new one)."""
        import distributed

        if self.cluster is not None and self.nworkers != nworkers:
            self.close()
        if self.cluster is None:
            self.cluster = distributed.LocalCluster(n_workers=nworkers, threads_per_worker=1, processes=True,
                                                    dashboard_address=":0", silence_logs=50)
            self.nworkers = nworkers
        client = distributed.Client(self.cluster)
        client.wait_for_workers(nworkers, timeout=_WORKER_WAIT)
        return client

    def restore(self, client) -> bool:
        """Close ``client`` once every worker answers again (the killed ones restarted) and the
        scheduler has forgotten its tasks; False when that does not happen in time, or when a worker
        keeps a test seam."""
        import time

        import crashpoints

        end, ok = time.monotonic() + _RESTART_WAIT, False
        try:
            while not ok:
                workers = client.sync(client.scheduler.identity)["workers"]
                if len(workers) == self.nworkers:
                    try:
                        seams = client.run(crashpoints.seams, workers=list(workers))
                    except Exception:  # a killed worker still listed: it drops out, its successor comes
                        seams = None
                    if seams is not None:
                        if any(seams.values()):
                            return False
                        ok = True
                if not ok and (time.monotonic() > end or len(self.cluster.workers) < self.nworkers):
                    return False  # (a nanny that gave up restarting its worker is gone from the cluster)
                time.sleep(0 if ok else 0.05)
        finally:
            client.close()
        scheduler, end = self.cluster.scheduler, time.monotonic() + 10
        while scheduler.tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        cluster, self.cluster, self.nworkers = self.cluster, None, 0
        if cluster is not None:
            from daskclose import close_cluster

            close_cluster(cluster)


def lose_node(pid: int, node_dir: Path | None = None) -> None:
    """A node lost at once: its worker process ``pid`` stopped (SIGSTOP: the cluster sees nothing yet), its node
    directory ``node_dir`` erased, then the process killed (SIGKILL).

    Dask computes a lost worker's chunks again as soon as the scheduler sees it gone. A directory erased after the
    kill raced that recomputation: a read on another worker found the node's file still there and read it (an L2
    chunk read back from "its file" instead of its partner copy), or rebuilt it into the directory being erased. A
    real node's disk goes with its process: here the files are gone before the cluster can notice the loss.
    """
    import signal

    os.kill(pid, signal.SIGSTOP)
    try:
        if node_dir is not None and node_dir.exists():
            shutil.rmtree(node_dir)
    finally:
        os.kill(pid, signal.SIGKILL)


def wait_for_replaced_workers(client, nworkers: int, timeout: float = 60) -> None:
    """Wait until ``client``'s LocalCluster has ``nworkers`` workers again after workers were killed.

    distributed's nanny restarts a killed worker; in about 2 of 20 runs of the Dask lineage tests (under
    load) a nanny was seen not to: no worker process, the nanny idle, the cluster one worker short for
    good. After ``timeout`` a new worker is added for each such nanny (``SpecCluster.scale``), so that the
    test goes on with a replacement node, as a real cluster's resource manager would give it.
    """
    try:
        client.wait_for_workers(nworkers, timeout=timeout)
        return
    except Exception:  # WorkerStartTimeoutError (a TimeoutError in older distributed)
        cluster = client.cluster
    stuck = [name for name, nanny in cluster.workers.items() if not nanny.is_alive()]
    print(f"adding a worker for each nanny that did not restart its killed worker: {stuck}", flush=True)
    cluster.scale(len(cluster.worker_spec) + len(stuck))  # the idle nannies stay until the cluster closes
    client.wait_for_workers(nworkers, timeout=120)


@pytest.fixture(scope="session")
def _dask_clusters():
    clusters = DaskClusters()
    yield clusters
    clusters.close()


@pytest.fixture
def dask_client(request, _dask_clusters):
    """A client of the shared LocalCluster of ``request.module.NWORKERS`` (default 2) worker processes,
    restored (or replaced) after the test: the test may kill workers, or install crash points in them."""
    pytest.importorskip("distributed")
    client = _dask_clusters.client(getattr(request.module, "NWORKERS", 2))
    yield client
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        client.close()
        _dask_clusters.close()
    elif not _dask_clusters.restore(client):
        _dask_clusters.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def small_moves(monkeypatch):
    """Recovery stages arrays from 256 KiB up (ftidask.engine.pagemove); its counters from zero."""
    from ftidask.engine import pagemove

    if not pagemove.enabled:
        pytest.skip("no native page_move in this build")
    monkeypatch.setattr(pagemove, "MIN_BYTES", 256 << 10)
    monkeypatch.setitem(pagemove.stats, "moved_bytes", 0)
