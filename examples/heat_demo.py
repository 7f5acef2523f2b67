"""Heat diffusion that survives being killed: checkpoint, SIGKILL, restart, recover, finish.

    python examples/heat_demo.py [--workdir DIR]

The driver runs the simulation in a child process, kills it with SIGKILL part-way through,
starts it again (the new process recovers the last checkpoint and carries on), then checks
the result bit for bit against a run that was never interrupted. Its files go to a temporary
directory, removed at the end; with ``--workdir DIR`` they go to DIR and stay there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

STEPS = 400
CKPT_EVERY = 25


def simulate(workdir: str, slow: float, say=print) -> np.ndarray:
    """The application: an explicit 2-D heat equation protected by ftidask."""
    import ftidask

    ctx = ftidask.init(ckpt_dir=f"{workdir}/Local", glbl_dir=f"{workdir}/Global", meta_dir=f"{workdir}/Meta",
                       verbosity=3)
    grid = np.zeros((256, 256))
    grid[100:150, 100:150] = 100.0
    step = np.zeros((), np.int64)  # the loop counter is protected too
    ctx.protect(1, grid, name="temperature")
    ctx.protect(2, step, name="step")
    if ctx.status() != 0:
        ctx.recover()
        say(f"  [app pid {os.getpid()}] restart: recovered checkpoint {ctx.recovered_from[0]} "
              f"(level {ctx.recovered_from[1]}), resuming at step {int(step)}", flush=True)
    else:
        say(f"  [app pid {os.getpid()}] fresh start", flush=True)
    while step < STEPS:
        grid[1:-1, 1:-1] += 0.2 * (grid[:-2, 1:-1] + grid[2:, 1:-1] + grid[1:-1, :-2] + grid[1:-1, 2:]
                                   - 4 * grid[1:-1, 1:-1])
        step += 1
        if step % CKPT_EVERY == 0:
            level = 4 if step % (4 * CKPT_EVERY) == 0 else 1
            info = ctx.checkpoint(int(step) // CKPT_EVERY, level)
            say(f"  [app] step {int(step)}: checkpoint {info.id} at L{level}, {info.bytes_written} bytes, "
                  f"{info.seconds * 1e3:.1f} ms", flush=True)
        time.sleep(slow)
    ctx.finalize()
    return grid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        np.save(args.out, simulate(args.workdir, slow=0.005))
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="ftidask-demo-")
    reference_dir = tempfile.mkdtemp(prefix="ftidask-demo-ref-")
    try:
        return demo(workdir, reference_dir)
    finally:
        shutil.rmtree(reference_dir, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"5. removed the demo's files ({workdir})")
        else:
            print(f"5. the demo's files are in {workdir} (Local/, Global/, Meta/: what finalize left; result.npy)")


def demo(workdir: str, reference_dir: str) -> int:
    """Run, kill, restart and compare; the exit status."""
    out = os.path.join(workdir, "result.npy")
    cmd = [sys.executable, __file__, "--child", "--workdir", workdir, "--out", out]
    print(f"1. starting the simulation ({STEPS} steps, a checkpoint every {CKPT_EVERY}) in {workdir}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="")
        if "checkpoint 5 " in line:
            time.sleep(0.05)
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print(f"2. killed the simulation with SIGKILL (exit status {proc.returncode}): no finalize, no cleanup")
    print("3. restarting it: the same command, nothing else changed")
    subprocess.run(cmd, check=True)
    print("4. comparing with a run that was never interrupted")
    reference = simulate(reference_dir, slow=0.0, say=lambda *a, **k: None)
    same = np.load(out).tobytes() == reference.tobytes()
    print(f"   final temperature field identical bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
