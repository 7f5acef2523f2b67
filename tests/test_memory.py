"""Data is written and read container by container: extra memory stays bounded on a 1 GiB state."""

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
