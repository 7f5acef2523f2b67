"""``python -m ftidask`` / ``ftidask``: inspect, verify, list, clean, export and import checkpoints.

How the commands find and check the files they are given is :mod:`ftidask.tools.file_checks`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..engine.runstate import check_exec_id
from ..ftiff.dump import shown_name, to_json, to_text
from ..ftiff.filekind import is_config_file
from ..ftiff.fti_dcp_posix import is_dcp_file
from ..ftiff.reader import parse_ftiff
from ..model.errors import FormatError, FTIError
from ..staging import journal
from ..storage import runlock
from ..storage.files import is_inside, open_read, read_json, remove_inside
from . import listing
from .file_checks import check_config_file as check_config_file
from .file_checks import (
    ftiff_files,
    is_store,
    load_checked_config,
    parity_files,
    parity_verdict,
    verdict_of,
    whole_file_problem,
    zarr_stores,
)
from .fti_files_cli import inspect_dcp, list_dcp_files
from .shown import shown, shown_message

DESCRIPTION = ("Inspect, verify, list and clean the checkpoints of ftidask (FTI-FF files), export one to Zarr "
               "or import a Zarr store. Run 'ftidask COMMAND --help' for a command's options.")


def _error(message: str) -> int:
    """Print ``ftidask: error: message`` (argparse's form) on stderr; the exit status 2."""
    print(f"ftidask: error: {message}", file=sys.stderr)
    return 2


def _missing(path: Path, base: bool = True) -> int:
    hint = " (check the path: the base directory is the one holding Local/, Global/ and Meta/)" if base else ""
    return _error(f"{path} does not exist{hint}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """``ftidask inspect FILE``: print a checkpoint file's structure (blocks, containers, variables)."""
    from ..engine.pystate import read_states

    if is_config_file(Path(args.file)):  # a checkpoint is binary: this is FTI's config.fti, not Ckpt*-Rank*.fti
        return _error(f"{args.file} is a config file, not a checkpoint file: `ftidask list --config {args.file}` "
                      "lists its run's checkpoints, and inspect takes one of their Ckpt*-Rank*.fti files")
    if is_dcp_file(args.file):  # FTI's POSIX dCP file: its own layout, checked with its meta file
        return inspect_dcp(args.file, args.json)
    try:
        with open_read(args.file) as fh:
            parsed = parse_ftiff(fh, args.file)
            states = read_states(fh, parsed)  # Python state (ftidask.State, Value, generators): its value
    except (FormatError, OSError) as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps(to_json(parsed) | ({"python_state": {str(vid): {"kind": kind, "value": text} for vid, (
            kind, text) in states.items()}} if states else {}), indent=1))
    else:
        print(to_text(parsed) + "".join(
            ["\n\nPython state:"] + [f"\n    id {vid} {shown_name(parsed.vars[vid].name)}: Python state {kind} = "
                                     f"{text if text.isprintable() else repr(text)[1:-1]}"
                                    for vid, (kind, text) in states.items()] if states else []))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``ftidask verify PATH``: check every hash of a file, a checkpoint directory or a run; 0 when sound."""
    root = Path(args.path)
    if not root.exists():
        return _missing(root, base=False)
    if args.meta:
        return _verify_posix(root, args.meta)
    if is_config_file(root):  # a run's config: its checkpoint directories
        cfg = load_checked_config(root)
        roots = [p for p in (Path(cfg.ckpt_dir), Path(cfg.glbl_dir)) if p.is_dir()]
        files = [f for r in roots for f in ftiff_files(r) + parity_files(r) + zarr_stores(r)]
    else:
        one = root.is_file() or root.suffix == ".zarr" or is_store(root)  # a store by its content, any name
        files = [root] if one else ftiff_files(root) + parity_files(root) + zarr_stores(root)  # L4 as Zarr, exports
    if not files and is_config_file(root):
        return _error(f"no checkpoint files under {Path(cfg.ckpt_dir).absolute()} or {Path(cfg.glbl_dir).absolute()}"
                      f" (the directories of {root}; relative ones are taken from the current directory)")
    if not files:
        return _error(f"no checkpoint files (FTI-FF files, L3 parity files, Zarr stores) under {shown(root)}")
    bad = 0
    for path in files:
        kind, detail = parity_verdict(path) if "RSed" in path.name and path.suffix == ".fti" else verdict_of(path)
        whole = whole_file_problem(path) if kind == "ok" and "-Rank" in path.name else ""
        kind, detail = ("damaged", whole) if whole else (kind, detail)
        if kind == "ok":  # names found on disk, messages quoting them: never a terminal's control characters
            print(f"OK       {shown(path)}")
        else:
            bad += 1
            print(f"DAMAGED  {shown_message(str(detail))}")
    print(f"{len(files) - bad} sound, {bad} damaged")
    return 1 if bad else 0


def _verify_posix(root: Path, meta: str) -> int:
    """verify --meta: FTI's POSIX files (``root``, or its rank, partner, parity, MPI-IO files) against meta files."""
    from ..ftiff.posix import meta_files, posix_files, verify_posix

    try:  # a --meta that names no meta file is a wrong argument (status 2), not a damaged checkpoint file
        meta_files(meta)
    except FormatError as exc:
        return _error(f"--meta {meta}: {exc}")
    files = [root] if root.is_file() else posix_files(root)
    if not files:
        return _error(f"no FTI POSIX file (Ckpt*-Rank*.fti, Ckpt*-Pcof*.fti, Ckpt*-RSed*.fti) in {root}")
    bad = 0
    for path in files:
        try:
            note = verify_posix(path, meta)
            print(f"OK       {shown(path)}" + (f" ({shown_message(note)})" if note else ""))
        except FormatError as exc:
            bad += 1
            print(f"DAMAGED  {shown_message(str(exc))}")
    print(f"{len(files) - bad} sound, {bad} damaged")
    return 1 if bad else 0


def _dir_or_config(args: argparse.Namespace) -> int | None:
    """``list``/``clean``: DIR and --config both given is an error (its exit status): the config's directories would
    be used, not DIR's (``clean`` would remove another run's files); DIR is the current directory by default."""
    if args.config and args.dir is not None:
        return _error(f"give DIR ({args.dir}) or --config CONFIG ({args.config}), not both: the config names the "
                      "directories")
    if args.dir is None:
        args.dir = "."
    return None


def _config_as_dir(args: argparse.Namespace) -> int | None:
    """``list``/``clean``: a ``DIR`` that is a config file stands for ``--config`` (as ``verify config.fti`` takes
    one; told apart by content); another file is an error (its exit status), a directory None."""
    path = Path(args.dir)
    if not args.config and path.exists() and not path.is_dir() and not path.is_file():  # a FIFO, a device
        return _error(f"{path} is not a directory: give the base directory (holding Local/, Global/ and Meta/) or "
                      "the run's config (--config CONFIG)")
    if args.config or not path.is_file():
        return None
    if not is_config_file(path):
        return _error(f"{path} is a file, not a directory: give the base directory (holding Local/, Global/ and "
                      "Meta/) or the run's config (--config CONFIG)")
    check_config_file(args.dir)
    args.config = args.dir
    return None


def _dirs(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    if args.config:
        cfg = load_checked_config(args.config)
        return Path(cfg.ckpt_dir), Path(cfg.glbl_dir), Path(cfg.meta_dir)
    base = Path(args.dir)
    return base / "Local", base / "Global", base / "Meta"


def cmd_list(args: argparse.Namespace) -> int:
    """``ftidask list``: the checkpoints of the runs under a directory (or a config's), with their state."""
    if (refused := _dir_or_config(args)) is not None:
        return refused
    if not args.config and not Path(args.dir).exists():
        return _missing(Path(args.dir))
    if (refused := _config_as_dir(args)) is not None:
        return refused
    local, glbl, meta = _dirs(args)
    roots = [p for p in (local, glbl) if p.is_dir()] or ([local, glbl] if args.config else [Path(args.dir)])
    groups = listing.collect(roots, meta)
    if not groups:
        print(f"no checkpoints under {', '.join(map(shown, roots))}")
        return list_dcp_files(roots, meta)
    print(listing.HEADER)
    for (exec_id, seq), files in sorted(groups.items()):
        print(listing.row(exec_id, seq, files, meta))
    return list_dcp_files(roots, meta)


def _runs_to_clean(args: argparse.Namespace, meta: Path, stage: Path) -> set[str]:
    if args.exec_id is not None:
        return {check_exec_id(args.exec_id, "--exec-id")}  # a single directory name, never a path
    runs = set()  # a stage directory outlives its run's state when the application's files wait there
    for p in [*(meta.iterdir() if meta.is_dir() else ()), *(stage.iterdir() if stage.is_dir() else ())]:
        # A directory of meta_dir is a run's when it holds a run's state: meta_dir may be ckpt_dir's or glbl_dir's
        # too, whose node* and stage directories (live runs' files in them) are none.
        if p.is_dir() and (p.parent == stage or any((p / n).exists() for n in ("run.json", "run.lock", "commits"))):
            try:
                runs.add(check_exec_id(p.name, f"directory {p}"))
            except FTIError as exc:
                print(f"skipping {exc}", file=sys.stderr)
    return runs


def cmd_clean(args: argparse.Namespace) -> int:
    """``ftidask clean``: remove the files of finished or named runs (never those of a live one)."""
    if (refused := _dir_or_config(args)) is not None:
        return refused
    if not args.config and not Path(args.dir).exists():
        return _missing(Path(args.dir))
    if (refused := _config_as_dir(args)) is not None:
        return refused
    local, glbl, meta = _dirs(args)
    stage = local / "stage"
    runs = _runs_to_clean(args, meta, stage)
    if args.exec_id and not any(p.exists() for p in [*local.glob(f"node*/{args.exec_id}"), glbl / args.exec_id,
                                                      meta / args.exec_id, stage / args.exec_id]):
        known = sorted(p.name for p in meta.iterdir() if p.is_dir()) if meta.is_dir() else []
        return _error(f"no such run: {args.exec_id!r} has no directories under {local}, {glbl} or {meta}"
                      f" (runs found: {', '.join(known) or 'none'})")
    for run in sorted(runs):
        if runlock.is_live(meta / run):  # a live run's files are its own: never deleted under it
            print(f"skipping run {run}: in use by {runlock.holder(meta / run)}")
            runs.discard(run)
    if not runs:
        print("nothing to clean")
        return 0
    targets = list(dict.fromkeys(  # once each: glbl_dir and meta_dir may be one directory
        (p, parent) for run in sorted(runs) for p, parent in
        [*((p, p.parent) for p in local.glob(f"node*/{run}")), (glbl / run, glbl), (meta / run, meta)]
        if p.exists()))
    tidied = [stage / run for run in sorted(runs) if (stage / run).is_dir()]
    print("will remove:\n  " + "\n  ".join([shown(p) for p, _parent in targets] + [
        f"{shown(p)} (what staging left; the application's files waiting there are kept)" for p in tidied]))
    if not args.yes:
        if not sys.stdin.isatty():
            return _error("refusing to delete without confirmation (no terminal to ask on); pass --yes")
        try:
            answer = input("proceed? [y/N] ")
        except EOFError:  # Ctrl-D: no
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            return 1
    refused = 0
    with runlock.choosing(meta) if meta.is_dir() else contextlib.nullcontext():  # no init adopts a run meanwhile
        live = {run for run in runs if runlock.is_live(meta / run)}  # started since the question
        for target, parent in targets:
            if target.name in live:
                print(f"skipping {target}: its run is in use by {runlock.holder(meta / target.name)}", file=sys.stderr)
                refused += 1
            elif not remove_inside(target, parent):
                print(f"refusing to remove {target}: it does not resolve inside {parent}", file=sys.stderr)
                refused += 1
            elif os.path.lexists(target):  # remove_tree warned of what it could not remove
                print(f"could not remove all of {target}", file=sys.stderr)
                refused += 1
        for target in (p for p in tidied if p.name not in live and is_inside(p, stage)):
            if left := journal.tidy_stage(target, glbl):  # the application's own files: never removed by ftidask
                print(f"kept {left} file(s) that the application left to stage in {target}")
        with contextlib.suppress(OSError):
            stage.rmdir()
        current = meta / "current_exec_id"
        named = read_json(current)
        if current.is_file() and (not isinstance(named, dict) or not isinstance(named.get("exec_id"), str)
                                  or named["exec_id"] in runs - live):
            os.unlink(current)
    print(f"removed {len(targets) - refused} directories")
    return 1 if refused else 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command per ``cmd_*`` function."""
    parser = argparse.ArgumentParser(prog="ftidask", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a file's FTI-FF structure")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every hash of a file, or of every file under a directory")
    p.add_argument("path")
    p.add_argument("--meta", help="FTI's meta file (or its directory) of files of FTI's POSIX I/O (ckpt_io = 1) or "
                   "its MPI-IO file (ckpt_io = 2: every rank's part)")
    p.set_defaults(func=cmd_verify)
    for name, func, text in (("list", cmd_list, "list the checkpoints found"),
                             ("clean", cmd_clean, "remove a run's checkpoints")):
        p = sub.add_parser(name, help=text)
        p.add_argument("dir", nargs="?", default=None,
                       help="base directory holding Local/, Global/, Meta/ (or a config file, as --config); "
                       "default: the current directory")
        p.add_argument("--config", help="an FTI-style config file naming the directories")
        if name == "clean":
            p.add_argument("--exec-id", help="only this run (default: every run under Meta/)")
            p.add_argument("--yes", "-y", action="store_true", help="do not ask")
        p.set_defaults(func=func)
    for hook in _EXTRA_COMMANDS:
        hook(sub)
    return parser


#: Functions ``(subparsers) -> None`` that add commands from optional modules (export, ...).
_EXTRA_COMMANDS: list = []


def _add_zarr_commands(sub: argparse._SubParsersAction) -> None:
    from .zarr_export import add_export_command  # export/import: Zarr is imported only when they run

    add_export_command(sub)


_EXTRA_COMMANDS.append(_add_zarr_commands)


#: The arguments that name a file or directory (their ``dest``): an empty one is refused, never taken for ".".
_PATH_ARGS = frozenset({"checkpoint", "config", "dir", "file", "meta", "path", "store", "to_zarr"})


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ftidask`` command: its exit status (errors are one line on stderr, never a traceback)."""
    for stream in (sys.stdout, sys.stderr):  # names and values read from files: what the terminal cannot encode
        with contextlib.suppress(AttributeError, ValueError):  # (a lone surrogate) escaped, never a traceback
            stream.reconfigure(errors="backslashreplace")
    try:
        args = build_parser().parse_args(argv)  # inside: --help into a closed pipe ends quietly too
        empty = sorted(name for name, value in vars(args).items() if value == "" and name in _PATH_ARGS)
        if empty:  # Path("") is ".": ``clean --config "$UNSET"`` would remove the current directory's runs
            return _error(f"an empty value for {', '.join(empty)}: give a path (or leave the option out)")
        if getattr(args, "config", None):  # list/clean --config, import's config: say what is wrong with it
            check_config_file(args.config)
        code = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return code
    except FTIError as exc:
        return _error(str(exc))
    except BrokenPipeError:
        # The reader went away (ftidask list | head): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UnicodeDecodeError as exc:  # a binary file read as text
        return _error(f"a file given is binary where a text (INI) file was expected: {exc.reason}")
    except IsADirectoryError as exc:
        return _error(f"{exc.filename} is a directory where a file was expected")
    except OSError as exc:
        return _error(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))


if __name__ == "__main__":
    sys.exit(main())
