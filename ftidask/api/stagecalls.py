"""FTI's staging calls on a :class:`ftidask.Context` (FTI_GetStageDir, FTI_SendFile, FTI_GetStageStatus): a mixin
over the context's :class:`~ftidask.staging.stager.Staging` (see docs/staging.md)."""

from __future__ import annotations

import os
from pathlib import Path

from ..staging.stager import StageInfo, Stager, Staging, request_id_of


class StagingCalls:
    """The staging methods of a context, which holds ``_staging`` and ``_check_open``."""

    _staging: Staging

    def _check_open(self) -> None:  # the context's own
        raise NotImplementedError

    @property
    def _stager(self) -> Stager | None:  # the running stager, if a request started it (the tests look at it)
        return self._staging.stager

    def stage_dir(self) -> Path:
        """FTI_GetStageDir: this process's node-local stage directory (created on demand)."""
        self._check_open()
        return self._staging.get().stage_dir

    def send_file(self, local_path: str | os.PathLike[str], remote_path: str | os.PathLike[str]) -> int:
        """FTI_SendFile: move ``local_path`` (in :meth:`stage_dir`) to ``remote_path`` in the background.

        ``remote_path`` is taken under ``glbl_dir`` when relative; a directory (or a trailing ``/``)
        receives the file under its own name. Returns the request id for :meth:`stage_status`.
        Raises :class:`StagingError` at once for bad input.
        """
        self._check_open()
        return self._staging.get().send(local_path, remote_path)

    def stage_status(self, request_id: int) -> int:
        """FTI_GetStageStatus: SI_PEND, SI_ACTV, SI_SCES or SI_FAIL (each final state once), else SI_NINI."""
        self._check_open()
        return self._staging.get().table.query(request_id_of(request_id))

    def stage_info(self, request_id: int) -> StageInfo | None:
        """The request's state, reason, paths and times (a :class:`StageInfo`), or None for an unknown id. It does
        not consume a final state, and still knows a request whose final state stage_status returned, for the last
        1024 of them (``reason`` says why one failed)."""
        self._check_open()
        return self._staging.get().table.info(request_id_of(request_id))

    def wait_staged(self, request_id: int | None = None, timeout: float | None = None) -> int | dict[int, int]:
        """Wait for one request (its state, ``SI_NINI`` if unknown) or, with ``request_id`` None, every one whose
        final state was not yet read (``{id: state}``), at most ``timeout`` seconds (None: no limit); final states
        are not consumed."""
        self._check_open()
        return self._staging.get().wait(request_id, timeout)
