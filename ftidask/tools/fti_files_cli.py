"""``ftidask`` commands on files FTI itself writes that are not FTI-FF checkpoints: its level-3 parity files (their MD5
checked by ``verify``) and its POSIX differential checkpoints, ``dcp-id{f}-rank{r}.fti`` (``inspect`` prints what
the file says of itself; ``list`` checks each against the meta file FTI keeps for it,
``{meta_dir}/{exec_id}/l4`` or ``l1``, and says what it holds; :mod:`ftidask.ftiff.fti_dcp_posix`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..ftiff.fti_dcp_posix import DCP_NAME, is_dcp_file, read_dcp_head, read_dcp_posix
from ..model.errors import FormatError, RecoveryError
from ..storage.files import find_paths, open_read
from .shown import shown, shown_message


def fti_parity_problem(path: Path) -> str:
    """A parity file without ftidask's .hash record: FTI's own (its MD5 checked), else ftidask's without record."""
    from ..ftiff.ftiparity import parity_problem, sniff_parity
    from ..levels.rs import check_parity

    try:
        with open_read(path) as fh:
            parity = sniff_parity(fh.fileno(), os.fstat(fh.fileno()).st_size)
            problem = parity_problem(fh.fileno(), parity) if parity is not None else ""
    except OSError as exc:
        return f"{path}: {exc}"
    if parity is None:  # not FTI's: ftidask's parity file, its record missing (check_parity says so)
        return check_parity(path)
    return f"{path}: {problem}" if problem else ""


def inspect_dcp(path: str, as_json: bool) -> int:
    """``ftidask inspect dcp-id{f}-rank{r}.fti``: its header and layer 0 (the later layers' bounds are in the meta
    file: ``ftidask verify PATH --meta META`` checks them); 0, or 2 with the reason on stderr."""
    try:
        head = read_dcp_head(path)
    except FormatError as exc:
        print(f"ftidask: error: {exc}", file=sys.stderr)
        return 2
    file_id, rank = DCP_NAME.fullmatch(os.path.basename(path)).groups()  # type: ignore[union-attr]
    if as_json:
        print(json.dumps({"kind": "FTI POSIX dCP file", "file_id": int(file_id), "rank": int(rank)} | head, indent=1))
        return 0
    print(f"FTI POSIX differential checkpoint file {path} (file id {file_id}, rank {rank}): {head['file_size']} "
          f"bytes, {head['layout']} layout, block size {head['block_size']}, stack size {head['stack_size']}\n"
          f"  layer 0: checkpoint {head['ckpt_id']}, {head['layer0_size']} bytes, {len(head['variables'])} "
          "variables" + "".join(f"\n    id {vid}: {n} bytes" for vid, n in head["variables"]) +
          f"\n  later layers: {head['file_size'] - head['layer0_size']} bytes (their bounds and hashes are in the "
          "meta file: ftidask verify PATH --meta META_DIR)")
    return 0


def list_dcp_files(roots: list[Path], meta: Path) -> int:
    """``ftidask list``: FTI's POSIX dCP files under ``roots`` (``{exec_id}/dCP/``), each checked against the meta
    file of level 4, else 1, of its run under ``meta``; 0."""
    found = [p for root in roots for p in find_paths(root, "dcp-id*-rank*.fti") if is_dcp_file(p)]
    if found:
        print("\nFTI POSIX differential checkpoint files (read with recover_file(path, meta=...)):")
    for path in found:
        exec_id = path.parent.parent.name
        state = f"no meta file of run {exec_id} names it (looked in {meta / exec_id}/l4 and l1)"
        for level in (4, 1):
            where = meta / exec_id / f"l{level}"
            try:
                got = read_dcp_posix(path, where)
            except FormatError as exc:
                if "no section" in str(exc) or "no FTI meta file" in str(exc) or "no such FTI meta" in str(exc):
                    continue
                state = f"DAMAGED: {exc}"
                break
            except RecoveryError as exc:  # not enough memory to check it here: not damage
                state = f"not checked: {exc}"
                break
            sizes = ", ".join(f"id {vid}: {len(b)} bytes" for vid, b in got.data.items())
            state = f"sound, as of the checkpoint the meta file of level {level} names ({sizes})"
            break
        print(f"  {shown(path)}: {shown_message(state)}")  # names found on disk: never a terminal's control
    return 0
