"""FTI_GetStoredSize and FTI_Realloc on a restart: answered from the checkpoint a restart recovers, found as
recover() finds it (collective), parsed and verified once, and kept in the context's :class:`Progress`.

A base of :class:`~ftidask.engine.recovering.Recovery`, separate from :mod:`ftidask.engine.recovering` (the
search and the loading of a recovery), which it serves: its search is :meth:`Recovery.find`'s.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ftiff.reader import FtiffFile
from ..model.arrays import check_id
from ..model.errors import FTIError, NoCheckpointError, ProtectError, RecoveryError
from ..transport.collective import agree_call
from . import recoverplan, reshard
from .device import is_device_array
from .recovery import Verdict
from .reshard_rebuild import old_files_sound
from .run import RunPart
from .runstate import CommitRecord
from .variables import Protected, check_name, protected_var

if TYPE_CHECKING:
    from .recovering import Progress


class RestartSizes(RunPart):
    """The stored sizes and reallocation of a :class:`~ftidask.engine.recovering.Recovery`, which holds
    ``variables``, ``progress``, :meth:`find` and :meth:`all_candidates`."""

    variables: dict[int, Protected]
    progress: Progress

    def find(self, ckpt_id: int | None = None, level: int | None = None, stage: Any = None,
             records: list[CommitRecord] | None = None) -> tuple[CommitRecord, Verdict]:  # the recovery's own
        raise NotImplementedError

    def all_candidates(self, ckpt_id: int | None, level: int | None,
                       error: type[FTIError] = RecoveryError) -> list[CommitRecord]:  # the recovery's own
        raise NotImplementedError

    def restart_metadata(self) -> FtiffFile:
        """The checkpoint a restart recovers, parsed and verified (found once; collective the first time)."""
        if self.progress.restart_file is None:
            record, verdict = self._restart_find()
            self.progress.restart_file, self.progress.restart_record = verdict.parsed, record
            self.progress.restart_newest = True
        assert self.progress.restart_file is not None
        return self.progress.restart_file

    def _restart_find(self) -> tuple[CommitRecord, Verdict]:
        """The checkpoint recover() loads, sought as it does: each run of candidates of one layout in turn (collective,
        agreed). When it is one of another layout, redistributed, its sizes per old rank describe nothing loaded: a
        RecoveryError. One of another layout that cannot be redistributed is passed over, as recover() does."""
        if self.progress.resharded is not None:  # what recover() redistributed: refused as such, never sought again
            raise reshard.sizes_refused(*self.progress.resharded)  # (a whole check of its files may fail where it read)
        failed: list[NoCheckpointError] = []
        for change, records in reshard.by_layout(self, self.all_candidates(None, None)):
            if not change:
                try:
                    return self.find(records=records)
                except NoCheckpointError as exc:  # agreed
                    failed.append(exc)
                    continue
            sound = next((r for r in records if old_files_sound(self, r, partial(reshard.old_path, self, r))), None)
            if sound is not None:
                t = self.transport
                raise reshard.sizes_refused(sound, reshard.layout_change(sound, t.size, t.allgather(t.node)))
            failed.append(NoCheckpointError(f"{change}; none of those checkpoints can be redistributed"))
        if not failed:
            return self.find(records=[])  # raises: no committed checkpoint
        raise failed[0] if len(failed) == 1 else NoCheckpointError("\n".join(map(str, failed)))

    def stored_size(self, id: Any) -> int:
        """:meth:`ftidask.Context.stored_size` of ``id`` (0: nothing stored for it). On a restart the sizes are read by
        every rank together: a rank whose id is refused takes part first (or the others would wait), then raises."""
        try:
            vid = check_id(id, "variable id")
        except FTIError:
            with contextlib.suppress(FTIError):
                self._stored_size(0)
            raise
        return self._stored_size(vid)

    def _stored_size(self, vid: int) -> int:
        """FTI_GetStoredSize's bytes of ``vid``, 0 where none is stored for it."""
        pr = self.progress
        if pr.restart_file is None and pr.layout is not None and (pr.last_checkpoint or pr.recovered):
            # From the layout's index of its variables: a dict of every variable's size built per call made
            # stored_size() of each of n variables O(n^2) (1.6 ms a call at 10,000 variables)
            return sum(s.chunksize for s in pr.layout.slots_of(vid))
        if pr.restart_file is None and not self.all_candidates(None, None):  # the same on every rank
            return 0  # nothing committed (a fresh run before its first checkpoint): FTI's 0 for every id
        return self.restart_metadata().var_nbytes().get(vid, 0)

    def realloc(self, id: Any, array: Any) -> Any:
        """:meth:`ftidask.Context.realloc` (collective: a rank whose arguments are refused tells the others)."""
        def step() -> tuple[dict[str, Any], int]:
            if array is not None and not isinstance(array, np.ndarray) and not is_device_array(array):
                raise ProtectError("realloc(id, array): array must be a numpy.ndarray, a CuPy array or None, got "
                                   f"{type(array).__name__}")
            return {}, check_id(id, "variable id")

        vid, variables = agree_call(self.transport, "realloc", step, RecoveryError), self.variables
        state = variables[vid].state if vid in variables else None
        if state is not None:  # a Python state resizes itself; the metadata read with the ranks whose id is an array
            with contextlib.suppress(FTIError):  # (collective: they would wait for this rank, or pair it with another)
                self.restart_metadata()
            return state.obj
        parsed = self.restart_metadata()
        info = parsed.vars.get(vid)
        new = recoverplan.realloc_array(parsed, vid, array, variables)
        name = info.name if info is not None else None
        # The stored name protected under another id since: two variables of one name (var_id finds either, a
        # restart cannot protect both as they were): refused as protect refuses it
        if vid not in variables and isinstance(name, str) and name:
            check_name(name, vid, variables)
        # registered as ctx.protect(vid, new, name=...) would (its compressor and declaration kept if they fit)
        variables[vid] = protected_var(vid, new, name if vid not in variables else variables[vid].name, None,
                                       variables.get(vid), global_shape=None, offset=None, replicated=False)
        return new
