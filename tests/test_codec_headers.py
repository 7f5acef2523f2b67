"""The raw size a codec's header declares is read before anything is decoded: a hostile file's bytes pass
their hash (its author computed it) and can declare anything, and the codec allocates what they declare
(a Zstd frame of 32 KiB unpacks to 1 GiB). A span that declares another size than its container's is damage.
"""

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")

from test_hostile_inputs import forge_committed, refused_untouched  # noqa: E402

import ftidask  # noqa: E402
from ftidask.ftiff import compression  # noqa: E402
from ftidask.ftiff.reader import parse_ftiff  # noqa: E402
from ftidask.model.errors import FormatError  # noqa: E402
from ftidask.tools.cli import main as cli_main  # noqa: E402

CODECS = [numcodecs.Zstd(level=1), numcodecs.Zstd(level=19), numcodecs.LZ4(),
          numcodecs.Blosc(cname="lz4", shuffle=1), numcodecs.Blosc(cname="zstd", clevel=9, shuffle=2)]
# Zstd stores its frame content size in 1, 2 (+256), 4 or 8 bytes: the sizes around each step.
SIZES = [1, 2, 255, 256, 257, 300, 65535, 65791, 65792, 65793, 70001, 1 << 22]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: repr(c))
def test_the_declared_size_is_the_encoded_size(codec):
    rng = np.random.default_rng(0)
    for n in SIZES:
        raw = rng.integers(0, 4, n, dtype=np.uint8)
        stored = bytes(codec.encode(raw))
        assert compression.declared_size(codec.codec_id, stored) == n
        assert bytes(compression.decode_span(codec, stored, n)) == raw.tobytes()
        into = bytearray(n + 3)  # decoded in place, nothing written past the span
        compression.decode_span(codec, stored, n, into=memoryview(into)[1:n + 1])
        assert into == b"\0" + raw.tobytes() + b"\0\0"
        with pytest.raises(FormatError, match=f"declares {n} raw bytes, expected {n + 1}"):
            compression.decode_span(codec, stored, n + 1)
        with pytest.raises(FormatError, match="declares no size"):
            compression.decode_span(codec, stored[:3], n)


def test_a_zstd_bomb_is_refused_before_anything_is_allocated():
    bomb = bytes(numcodecs.Zstd(level=1).encode(np.zeros(1 << 30, np.uint8)))
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="declares 1073741824 raw bytes, expected 80000"):
            compression.decode_span(numcodecs.Zstd(), bomb, 80000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # decoding it first allocated the whole GiB


def test_a_forged_frame_header_is_damage_and_touches_nothing(dirs, capsys):
    ctx = ftidask.init(**dirs, compressor="zstd")
    ctx.protect(1, np.arange(10_000.0))
    ctx.protect(2, np.zeros(10_000))
    seq = ctx.checkpoint(1, 1).seq
    (path,) = Path(dirs["ckpt_dir"]).glob(f"**/ckpt1.s{seq}/Ckpt1-Rank0.fti")
    with open(path, "rb") as fh:
        meta = next(m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == 2)
        stored = os.pread(fh.fileno(), meta.chunksize, meta.fptr)
    assert stored[4] == 0xA0 and compression.declared_size("zstd", stored) == 80_000  # 4 bytes of size
    forged = stored[:5] + (0xFFFFFFFF).to_bytes(4, "little") + stored[9:]  # declares 4 GiB
    path = forge_committed(dirs, seq, 2, forged)
    assert cli_main(["verify", str(path)]) == 1
    assert "declares 4294967295 raw bytes, expected 80000" in capsys.readouterr().out
    refused_untouched(dirs, "header declares 4294967295")
