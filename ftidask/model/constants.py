"""FTI's constants, return codes and datatypes, mapped to Python and NumPy."""

from __future__ import annotations

import numpy as np

from .errors import ProtectError

#: FTI return codes, kept for code ported from C.
FTI_BUFS = 256
FTI_DONE = 1
FTI_SCES = 0
FTI_NSCS = -1
FTI_NREC = -2

#: Staging request states (FTI_GetStageStatus).
FTI_SI_FAIL = -2
FTI_SI_SCES = 0
FTI_SI_ACTV = 1
FTI_SI_PEND = 2
FTI_SI_NINI = 3
#: The same states under the short names used by ftidask.staging.stager.
SI_FAIL, SI_SCES, SI_ACTV, SI_PEND, SI_NINI = FTI_SI_FAIL, FTI_SI_SCES, FTI_SI_ACTV, FTI_SI_PEND, FTI_SI_NINI

#: FTI's datatypes as NumPy dtypes (C types of an LP64 platform).
FTI_CHAR = np.dtype(np.byte)
FTI_SHRT = np.dtype(np.short)
FTI_INTG = np.dtype(np.intc)
FTI_LONG = np.dtype("l")  # C long
FTI_UCHR = np.dtype(np.ubyte)
FTI_USHT = np.dtype(np.ushort)
FTI_UINT = np.dtype(np.uintc)
FTI_ULNG = np.dtype("L")  # C unsigned long
FTI_SFLT = np.dtype(np.single)
FTI_DBLE = np.dtype(np.double)
FTI_LDBE = np.dtype(np.longdouble)

FTI_DATATYPES: dict[str, np.dtype] = {
    "FTI_CHAR": FTI_CHAR,
    "FTI_SHRT": FTI_SHRT,
    "FTI_INTG": FTI_INTG,
    "FTI_LONG": FTI_LONG,
    "FTI_UCHR": FTI_UCHR,
    "FTI_USHT": FTI_USHT,
    "FTI_UINT": FTI_UINT,
    "FTI_ULNG": FTI_ULNG,
    "FTI_SFLT": FTI_SFLT,
    "FTI_DBLE": FTI_DBLE,
    "FTI_LDBE": FTI_LDBE,
}

#: Checkpoint levels: 1 local, 2 partner copy, 3 Reed-Solomon, 4 global file system.
LEVELS = (1, 2, 3, 4)
#: FTI's differential levels L1_DCP..L4_DCP.
DCP_LEVELS = (5, 6, 7, 8)
FTI_L1_DCP, FTI_L2_DCP, FTI_L3_DCP, FTI_L4_DCP = DCP_LEVELS


def init_type(itemsize: int) -> np.dtype:
    """FTI_InitType: an opaque fixed-size type of ``itemsize`` bytes.

    Prefer a structured NumPy dtype, which is stored with its fields. Raises :class:`ProtectError`
    (a ``ValueError``) unless ``itemsize`` is a positive int of at most 2**31 - 1 (NumPy's largest item).
    """
    # bool is an int to Python, not a size; a NumPy integer is one
    if isinstance(itemsize, bool) or not isinstance(itemsize, (int, np.integer)) or itemsize <= 0:
        raise ProtectError(f"init_type: itemsize must be a positive int, got {itemsize!r}")
    if itemsize > 2**31 - 1:  # NumPy's largest item (a C int)
        raise ProtectError(f"init_type: itemsize {itemsize} is larger than NumPy's largest item, 2**31 - 1 bytes")
    return np.dtype((np.void, int(itemsize)))
