"""The native helpers under hostile arguments and callers: sizes that wrap, sequences changed while they are
used. Each call that used to crash the interpreter runs in a child process, which must end with a Python
exception or cleanly, never by a signal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

native = pytest.importorskip("ftidask._native", reason="native helpers not built (no C compiler at install)")


def run_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter: its stdout; fails on a signal or a non-zero exit."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal)\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_gf_matmul_inputs_list_grown_while_the_kernel_runs():
    """The cleanup released as many buffers as the list held then, past the ones it had taken: a crash."""
    out = run_child("""
        import sys, threading
        import numpy as np
        import ftidask._native as nat
        nat.gf_set_isa("scalar")  # slow: the kernel is still running when the other thread gets the GIL
        sys.setswitchinterval(100)  # this thread gives the GIL up only where gf_matmul releases it
        ins = [np.ones(8 << 20, np.uint8) for _ in range(4)]
        outs = [bytearray(8 << 20)]
        go = threading.Event()
        def grow():
            go.wait()
            ins.extend([np.zeros(16, np.uint8)] * 5000)
        t = threading.Thread(target=grow)
        t.start()
        go.set()
        nat.gf_matmul(bytes([1, 2, 3, 4]), ins, outs)
        t.join()
        outs[0].append(0)  # every export released: resizable
        print(len(ins), outs[0][0])
    """)
    assert out.split() == ["5004", str(1 ^ 2 ^ 3 ^ 4)]


def test_gf_matmul_inputs_list_shrunk_while_the_kernel_runs():
    """Shrinking the list made the cleanup release the wrong views: the output's export leaked."""
    out = run_child("""
        import sys, threading
        import numpy as np
        import ftidask._native as nat
        nat.gf_set_isa("scalar")
        sys.setswitchinterval(100)
        ins = [np.ones(8 << 20, np.uint8) for _ in range(4)]
        out = bytearray(8 << 20)
        go = threading.Event()
        def shrink():
            go.wait()
            del ins[1:]
        t = threading.Thread(target=shrink)
        t.start()
        go.set()
        nat.gf_matmul(bytes([1, 2, 3, 4]), ins, [out])
        t.join()
        try:
            out.append(0)
            print("released", len(ins))
        except BufferError as exc:
            print("leaked", exc)
    """)
    assert out.split() == ["released", "1"]


def test_cow_new_regions_changed_by_index():
    """An item's __index__ emptied the caller's list while cow_new parsed its (borrowed) items: a crash."""
    out = run_child("""
        import numpy as np
        import ftidask._native as nat
        a = np.ones(1 << 20, np.uint8)
        regions = []
        class Evil:
            def __index__(self):
                regions.clear()
                return a.nbytes
        regions.extend([(a.ctypes.data, Evil())] + [(a.ctypes.data, a.nbytes)] * 3)
        try:
            handle = nat.cow_new(regions)
        except OSError as exc:  # no userfaultfd here: still no crash
            print("refused", exc.errno)
        else:
            print("taken", nat.cow_stats(handle)["pages"] >= 256)
            nat.cow_release(handle)
    """)
    assert out.split()[0] in {"taken", "refused"}
    assert out.split() != ["taken", "False"]


def test_cow_new_wrapping_regions_are_refused():
    """Page counts that wrap made the layout write far past its mapping: a crash."""
    out = run_child("""
        import ftidask._native as nat
        for regions in ([(2**64 - 4096, 8192)], [(0, 2**63 - 4096), (0, 2**63 - 4096)],
                        [(2**64 - 4096, 8192), (0, 2**63 - 4096), (0, 2**63 - 4096)]):
            try:
                nat.cow_new(regions)
                print("accepted")
            except OSError as exc:
                print(exc.errno)
    """)
    assert out.split() == ["22", "22", "22"]  # EINVAL, each


def test_cow_new_absurd_size_is_refused_before_it_costs_memory():
    """A 4 KiB array claimed as 256 GiB: refused by the mapping check, before per-page state is laid out."""
    out = run_child("""
        import resource
        import numpy as np
        import ftidask._native as nat
        a = np.ones(4096, np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            nat.cow_new([(a.ctypes.data, 2**38)])
            print("accepted")
        except OSError as exc:
            print(exc.errno, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
    """)
    errno_, grown_mib = out.split()
    assert errno_ == "22" and int(grown_mib) < 16


@pytest.mark.parametrize("nbytes", [2**64 - 4096, 2**64 - (2 << 20), 2**64 - (4 << 20)])
def test_page_map_size_that_wraps_is_refused(nbytes):
    """nbytes + 2 MiB wrapped: a small mapping came back as if it held nbytes."""
    with pytest.raises(OSError):
        native.page_map(nbytes, 0)


@pytest.mark.parametrize("data,block", [(b"ab", 2**63 - 1), (b"a" * 100, 2**63 - 50), (b"", 2**62 + 1)])
def test_xxh3_blocks_refuses_huge_block_sizes(data, block):
    """data.len + block - 1 overflowed (undefined behaviour; a negative block count in the message)."""
    with pytest.raises(ValueError, match="block_size must be at most"):
        native.xxh3_blocks(data, block, bytearray(16), 16)


def test_xxh3_blocks_largest_block_size_still_hashes():
    import xxhash

    out = bytearray(16)
    native.xxh3_blocks(b"abc", 2**62 - 1, out, 16)
    assert bytes(out) == xxhash.xxh3_128_digest(b"abc")
    native.xxh3_blocks(np.zeros(0, np.uint8), 2**62 - 1, bytearray(0), 16)
