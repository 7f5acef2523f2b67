"""The memory a process can take (ftidask.engine.memavail): MemAvailable, or its cgroup's room when lower.

A job in a container or under a batch system's cgroup sees the whole machine's MemAvailable; sizing buffers
from it (the asynchronous copy snapshots' pool: half of it) could take more than the job's limit and have it
killed. The files below are laid out as Linux lays them out (cgroup v2 and v1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftidask.engine import asyncckpt, memavail

GIB = 1 << 30


def machine(tmp_path: Path, available_gib: float = 100, cgroup: str = "0::/\n") -> tuple[str, str, str]:
    (tmp_path / "meminfo").write_text(f"MemTotal: 200000000 kB\nMemAvailable: {int(available_gib * GIB) >> 10} kB\n")
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "fs").mkdir(exist_ok=True)
    return str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "fs")


def group(root: str, rel: str, files: dict[str, str]) -> None:
    d = Path(root, rel)
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_cgroup_v2_room_counts_page_cache_as_free(tmp_path):
    meminfo, cgroup, root = machine(tmp_path, cgroup="0::/job/step\n")
    group(root, "job", {"memory.max": f"{8 * GIB}\n", "memory.current": f"{6 * GIB}\n",
                        "memory.stat": f"anon {5 * GIB}\nfile {GIB}\n"})
    group(root, "job/step", {"memory.max": "max\n", "memory.current": f"{6 * GIB}\n", "memory.stat": "file 0\n"})
    assert memavail.available_bytes(meminfo, cgroup, root) == 3 * GIB


def test_the_tightest_cgroup_wins(tmp_path):
    meminfo, cgroup, root = machine(tmp_path, cgroup="0::/job/step\n")
    group(root, "job", {"memory.max": f"{8 * GIB}\n", "memory.current": f"{6 * GIB}\n", "memory.stat": "file 0\n"})
    group(root, "job/step", {"memory.max": f"{2 * GIB}\n", "memory.current": f"{GIB + GIB // 2}\n",
                             "memory.stat": "file 0\n"})
    assert memavail.available_bytes(meminfo, cgroup, root) == GIB // 2


def test_a_cgroup_over_its_limit_has_no_room(tmp_path):
    meminfo, cgroup, root = machine(tmp_path, cgroup="0::/job\n")
    group(root, "job", {"memory.max": f"{GIB}\n", "memory.current": f"{2 * GIB}\n", "memory.stat": "file 0\n"})
    assert memavail.available_bytes(meminfo, cgroup, root) == 0


@pytest.mark.parametrize("limit, expected_gib", [(4 * GIB, 1.5), (9223372036854771712, 100)])
def test_cgroup_v1_memory_controller(tmp_path, limit, expected_gib):
    """v1: the memory controller's own hierarchy, its "no limit" a huge page-rounded number."""
    meminfo, cgroup, root = machine(tmp_path, cgroup="5:devices:/\n4:memory:/job\n0::/\n")
    group(root, "memory", {"memory.limit_in_bytes": f"{limit}\n", "memory.usage_in_bytes": f"{3 * GIB}\n",
                           "memory.stat": f"cache 1\ntotal_cache {GIB // 2}\n"})
    assert memavail.available_bytes(meminfo, cgroup, root) == int(expected_gib * GIB)


def test_a_machine_view_only_and_nothing_at_all(tmp_path):
    meminfo, cgroup, root = machine(tmp_path, available_gib=12)
    assert memavail.available_bytes(meminfo, cgroup, root) == 12 * GIB  # no limit anywhere
    missing = str(tmp_path / "none")
    assert memavail.available_bytes(missing, missing, missing) is None


def test_this_machine_and_the_async_pool_default():
    with open("/proc/meminfo") as fh:
        machine_view = next(int(x.split()[1]) << 10 for x in fh if x.startswith("MemAvailable:"))
    got = memavail.available_bytes()
    assert got is not None and 0 < got <= machine_view * 1.05  # MemAvailable moves between the two reads
    assert 0 < asyncckpt._default_buffer_limit() <= got * 0.55


def test_cgroup_v1_without_a_namespace_reads_the_process_own_cgroup(tmp_path):
    """The memory controller's whole hierarchy mounted: the process's own cgroup (its path in /proc/self/cgroup) has
    the limit, the root none."""
    meminfo, cgroup, root = machine(tmp_path, cgroup="7:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/job_7\n")
    group(root, "memory", {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": f"{50 * GIB}\n",
                           "memory.stat": "total_cache 0\n"})
    group(root, "memory/slurm/job_7", {"memory.limit_in_bytes": f"{16 * GIB}\n",
                                       "memory.usage_in_bytes": f"{10 * GIB}\n", "memory.stat": f"total_cache {GIB}\n"})
    assert memavail.available_bytes(meminfo, cgroup, root) == 7 * GIB
