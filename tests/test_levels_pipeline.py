"""The levels' overlapped block loop: the same results, in order, as the serial loop; exchanges on
the calling thread (collectives); a failing stage is recorded and the loop still runs to its end."""

from __future__ import annotations

import threading
import time

import pytest

from ftidask.levels.pipeline import overlapped


@pytest.mark.parametrize("count", [0, 1, 2, 7])
def test_same_as_the_serial_loop_in_order(count):
    caller = threading.get_ident()
    seen, exchanged_on = [], set()

    def read(i):
        time.sleep(0.001 * (count - i))  # later reads finish sooner: order must not depend on it
        return i * 10

    def exchange(i, block):
        exchanged_on.add(threading.get_ident())
        return (i, block + 1)

    errors: list[str] = []
    overlapped(count, read, exchange, lambda i, got: seen.append((i, got)), errors)
    assert seen == [(i, (i, i * 10 + 1)) for i in range(count)]
    assert errors == [] and exchanged_on <= {caller}


@pytest.mark.parametrize("count", [1, 3])
def test_a_single_block_fails_alike(count):
    def read(i):
        raise OSError(5, "Input/output error")

    errors: list[str] = []
    overlapped(count, read, lambda i, b: b, lambda i, g: 1 / 0, errors)
    assert sorted(e.split(":")[0] for e in errors) == ["read"] * count + ["write"] * count
    assert "Input/output error" in errors[0]


def test_a_failing_read_or_write_is_recorded_and_every_exchange_still_happens():
    exchanges, written = [], []

    def read(i):
        if i == 2:
            raise OSError(5, "Input/output error")
        return i

    def consume(i, got):
        if i == 4:
            raise MemoryError()
        written.append(got)

    errors: list[str] = []
    overlapped(6, read, lambda i, b: exchanges.append(b) or b, consume, errors)
    assert exchanges == [0, 1, None, 3, 4, 5]  # the group stays in step
    assert written == [0, 1, None, 3, 5]
    assert len(errors) == 2 and errors[0].startswith("read: ") and errors[1].startswith("write: ")


def test_at_most_one_read_ahead_and_one_write_behind():
    state = {"reads": 0, "writes": 0, "most_reads": 0, "most_writes": 0}
    lock = threading.Lock()

    def track(kind):
        with lock:
            state[kind] += 1
            state["most_" + kind] = max(state["most_" + kind], state[kind])
        time.sleep(0.002)
        with lock:
            state[kind] -= 1

    overlapped(20, lambda i: track("reads"), lambda i, b: b, lambda i, g: track("writes"), [])
    assert state["most_reads"] == 1 and state["most_writes"] == 1
