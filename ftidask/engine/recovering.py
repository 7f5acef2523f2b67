"""Recovery: the newest committed checkpoint that every rank can verify (or rebuild), then the arrays.

A mixin of :class:`ftidask.Context` (it provides ``transport``, ``paths``, ``state``, ``config``, ``_vars``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff.reader import FtiffFile
from ..model.arrays import check_id
from ..model.errors import FTIError, NoCheckpointError, RecoveryError
from ..storage import files as storage
from ..transport.collective import agree, attempt, guarded, on_root
from . import recoverplan, reshard
from .recovery import Verdict, check_file, load_file
from .runstate import CommitRecord

log = logging.getLogger("ftidask")


class RecoveryMixin:
    """FTI_Recover, FTI_GetStoredSize and FTI_Realloc."""

    transport: Any
    paths: Any
    state: Any
    config: Any
    exec_id: str


    def _candidates(self, ckpt_id: int | None, level: int | None,
                    error: type[FTIError] = RecoveryError) -> list[CommitRecord]:
        t = self.transport
        raw = on_root(t, lambda: [r.to_json() for r in self.state.records()], error,
                      "cannot read the run's commit records")
        records = [r for r in (CommitRecord.from_json(x) for x in raw) if r is not None]
        if ckpt_id is not None:
            records = [r for r in records if r.ckpt_id == ckpt_id]
        if level is not None:
            records = [r for r in records if r.level == level]
        return sorted(records, key=lambda r: r.seq, reverse=True)

    def _rank_file(self, record: CommitRecord) -> Path:
        path = (self.paths.level_dir(record.level, self.transport.node) / record.dirname
                / storage.rank_file(record.ckpt_id, self.transport.rank))
        return path.with_suffix(".zarr") if record.extra.get("l4_format") == "zarr" else path

    def _check(self, record: CommitRecord) -> Verdict:
        """This rank's verdict on its file of ``record`` (an unexpected error is a damaged file, never raised)."""
        path, errors = self._rank_file(record), []
        verdict = guarded(errors, lambda: check_file(path, record, self.transport.rank), None, f"checking {path}")
        return verdict if verdict is not None else Verdict("damaged", "; ".join(errors))

    def _find(self, ckpt_id: int | None = None, level: int | None = None) -> tuple[CommitRecord, Verdict]:
        """The newest committed checkpoint that every rank can verify (or rebuild)."""
        t = self.transport
        reasons = []
        nodes = t.allgather(t.node)
        for record in self._candidates(ckpt_id, level):
            change = reshard.layout_change(record, t.size, nodes)
            if change:  # never rank r's old file into rank r blindly: recover() redistributes it, or says why not
                reasons.append(f"{change}; {reshard.advice(record)}")
                continue
            verdict = self._check(record)
            path = self._rank_file(record)
            ok = verdict.kind == "ok"
            # Collective (L2/L3); the transport keeps the ranks in step, an error after its end is this rank's.
            have, error = attempt(t.rank, lambda: t.rebuild_file(record.level, record.ckpt_id, path,  # noqa: B023
                                                                  path.parent, ok, record=record), False)
            if error:
                log.warning("rebuilding checkpoint %d (level %d): %s", record.ckpt_id, record.level, error)
            if not ok and have:
                verdict = self._check(record)
            # Consensus: every rank sees every verdict, so that all agree and raise the same error.
            verdicts = t.allgather([verdict.kind, verdict.message])
            if all(k == "ok" for k, _m in verdicts):
                return record, verdict
            bad = [(r, m) for r, (k, m) in enumerate(verdicts) if k != "ok"]
            why = f"{len(bad)} rank(s) cannot verify or rebuild their file, first rank {bad[0][0]}: {bad[0][1]}"
            reasons.append(f"checkpoint {record.ckpt_id} (level {record.level}): {why}")
            log.warning("cannot recover checkpoint %d (level %d): %s", record.ckpt_id, record.level, why)
        what = "no committed checkpoint" if not reasons else "no checkpoint verifies"
        raise NoCheckpointError(f"{what} for run {self.exec_id} in {self.paths.meta_dir}"
                                + (f" (ckpt_id={ckpt_id})" if ckpt_id is not None else "")
                                + (f" (level={level})" if level is not None else "")
                                + ("".join(f"\n  - {r}" for r in reasons)))

    def recover(self, ckpt_id: int | None = None, level: int | None = None, *,
                ids: Any = None) -> dict[int, Any]:
        """FTI_Recover: fill the protected arrays (and Python states) from the newest checkpoint that verifies.

        ``ids`` (FTI_RecoverVar): recover only these variables; the others are left untouched.
        Every hash is checked before any array is written; on failure nothing is touched.
        Raises :class:`NoCheckpointError` when nothing can be recovered.
        """
        self._check_open()
        wanted = recoverplan.normalize_ids(ids)
        resharded = reshard.recover_other_layout(self, ckpt_id, level, wanted)
        if resharded is not None:  # written on another number of ranks or node layout
            return resharded
        record, verdict = self._find(ckpt_id, level)
        assert verdict.parsed is not None
        t = self.transport
        untouched = (f"cannot recover checkpoint {record.ckpt_id} (level {record.level}); the protected arrays "
                     "are untouched")
        # Every rank agrees on each step before the next: what to fill, then the Python states decoded.
        targets, error = attempt(t.rank, lambda: recoverplan.plan(self._vars, verdict.parsed, wanted))
        agree(t, error or (f"rank {t.rank}: {targets.problem}" if targets.problem else ""), RecoveryError, untouched)
        problem, error = attempt(t.rank, targets.load_states)
        agree(t, error or (f"rank {t.rank}: {problem}" if problem else ""), RecoveryError, untouched)

        def load() -> None:
            load_file(verdict.parsed, targets.arrays, config=self.config)
            targets.apply_states()
            if self.config.enable_dcp:
                self._dcp_store().recovered(record.level, record.seq, self._rank_file(record), verdict.parsed)

        agree(t, attempt(t.rank, load)[1], RecoveryError,
              f"recovering checkpoint {record.ckpt_id} (level {record.level}) failed while loading, and the protected "
              "arrays may hold part of it: recover again")
        self._layout = verdict.parsed.layout()
        self._recovered = True
        self.recovered_from = (record.ckpt_id, record.level)
        self._next_ckpt_id = max(self._next_ckpt_id, record.ckpt_id + 1)
        log.info("recovered checkpoint %d from level %d%s", record.ckpt_id, record.level,
                 "" if wanted is None else f" (variables {wanted})")
        return targets.recovered()

    def recover_var(self, id: int, ckpt_id: int | None = None, level: int | None = None) -> Any:
        """FTI_RecoverVar: recover variable ``id`` only (every other protected variable is untouched)."""
        return self.recover(ckpt_id, level, ids=[id])[check_id(id, "variable id")]

    def recover_file(self, path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
        """Fill the protected arrays from one FTI-FF file (ftidask's, or one written by FTI 1.1).

        For files outside a run's directories, e.g. checkpoints copied by hand. Verified first.
        """
        self._check_open()
        verdict = check_file(Path(path), None, self.transport.rank)
        if verdict.kind != "ok" or verdict.parsed is None:
            raise RecoveryError(f"cannot recover from {os.fspath(path)}: {verdict.message}")
        targets = recoverplan.plan(self._vars, verdict.parsed, None)
        problem = targets.problem or targets.load_states()
        if problem:
            raise RecoveryError(problem)
        load_file(verdict.parsed, targets.arrays)
        targets.apply_states()
        self._layout = verdict.parsed.layout()
        self._recovered = True
        return targets.recovered()

    def _restart_metadata(self) -> FtiffFile:
        if self._restart_file is None:
            self._restart_file = self._find()[1].parsed
        assert self._restart_file is not None
        return self._restart_file

    def stored_size(self, id: int) -> int:
        """FTI_GetStoredSize: bytes of variable ``id`` in the checkpoint (last written, or to recover)."""
        self._check_open()
        vid = check_id(id, "variable id")
        if self._layout is not None and self._restart_file is None and (self.last_checkpoint or self._recovered):
            sizes = {s.var_id: 0 for s in self._layout.slots()}
            for s in self._layout.slots():
                sizes[s.var_id] += s.chunksize
        else:
            sizes = self._restart_metadata().var_nbytes()
        if vid not in sizes:
            raise RecoveryError(f"variable {vid} is not in the checkpoint (it holds ids {sorted(sizes)})")
        return sizes[vid]

    def realloc(self, id: int, array: Any = None) -> np.ndarray:
        """FTI_Realloc: a new array of the stored size, which becomes the protected one."""
        self._check_open()
        vid = check_id(id, "variable id")
        if vid in self._vars and self._vars[vid].state is not None:  # a Python state resizes itself
            return self._vars[vid].state.obj
        parsed = self._restart_metadata()
        info = parsed.vars.get(vid)
        if info is not None:
            new = info.empty()
        else:
            nbytes = parsed.var_nbytes().get(vid)
            if nbytes is None:
                raise RecoveryError(f"variable {vid} is not in the checkpoint")
            dtype = (array.dtype if isinstance(array, np.ndarray) else
                     self._vars[vid].array.dtype if vid in self._vars else np.dtype(np.uint8))
            if nbytes % dtype.itemsize:
                raise RecoveryError(f"variable {vid}: {nbytes} stored bytes are not a whole number of {dtype}")
            new = np.empty(nbytes // dtype.itemsize, dtype)
        if isinstance(array, np.ndarray) and array.dtype == new.dtype and array.shape == new.shape:
            new = array
        name = info.name if info is not None else None
        self.protect(vid, new, name=name if vid not in self._vars else self._vars[vid].name)
        return new
