import numpy as np

import ftidask


def test_roundtrip_l1(tmp_path):
    ctx = ftidask.init(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m")
    a = np.arange(100, dtype=np.float64)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    saved = a.copy()
    a[:] = -1
    ctx2 = ftidask.init(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m")
    assert ctx2.status() == 1
    b = np.zeros(100)
    ctx2.protect(1, b)
    ctx2.recover()
    assert b.tobytes() == saved.tobytes()
