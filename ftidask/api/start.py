"""``ftidask.init``: the config read once, then the backend that runs it, found in a registry and
imported on demand (``import ftidask`` never imports mpi4py or distributed)."""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from ..ftiff import compression
from ..model.config import Config
from ..model.errors import ConfigError, FTIError
from . import logsetup
from .context import Context


def _rank_of(comm: Any) -> int:
    try:
        return int(comm.Get_rank())
    except Exception:  # not a communicator: make_mpi_context says so
        return 0



#: The backends ``init`` can start, by name: ``module:function`` making their Context. They sit above
#: this layer (they build on :class:`Context`) and their modules import mpi4py or distributed, so they
#: are imported only when a run asks for one.
BACKENDS = {
    "mpi": "ftidask.backends.mpi.transport:make_mpi_context",
    "dask": "ftidask.backends.dask.context:make_dask_context",
}


def backend(name: str) -> Any:
    """The Context factory of backend ``name`` (imported on first use)."""
    module, _, function = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), function)

def init(config: str | os.PathLike[str] | Config | None = None, *, comm: Any = None, client: Any = None,
         **overrides: Any) -> Context:
    """FTI_Init: read the config (an FTI-style INI file, or defaults) and start or restart a run.

    ``comm`` (an mpi4py communicator) selects the MPI backend, ``client`` (a distributed.Client)
    the Dask backend; with neither, one process. ``verbosity`` set here or in the config file
    (1 debug, 2 a line per checkpoint and recovery, 3 warnings, 4 errors) prints ftidask's log on
    stderr, unless the application has configured :mod:`logging` itself (see
    :func:`ftidask.log_to_stderr`).
    """
    from ..model.config import keys_in_file, load_config

    try:
        cfg = load_config(config, **overrides).with_absolute_dirs()  # every backend, MPI heads included
        if cfg.compressor is not None:  # its codec can be had (numcodecs installed): here, not at every checkpoint
            compression.parse_compressor(cfg.compressor)
    except (FTIError, OSError) as raised:
        exc = raised if isinstance(raised, FTIError) else ConfigError(  # e.g. relative directories, cwd removed
            f"the run's directories cannot be resolved: {raised}")
        if comm is None or client is not None:
            if exc is raised:
                raise
            raise exc from raised
        # One rank's config refused (a file its node cannot read, a value of its own): the others are told in
        # the MPI backend's first collective and raise the same error, instead of waiting in it forever.
        return backend("mpi")(None, comm, refused=exc)  # type: ignore[no-any-return]
    if isinstance(config, Config):  # built by the application: explicit where it differs from the default
        explicit = "verbosity" in overrides or config.verbosity != Config().verbosity
    else:
        explicit = "verbosity" in overrides or (config is not None and "verbosity" in keys_in_file(config))
    logsetup.apply_verbosity(cfg.verbosity, explicit, 0 if comm is None else _rank_of(comm))
    if cfg.ckpt_io != 3:
        from ..model.config import IO_MODES

        logging.getLogger("ftidask").warning(
            "ckpt_io = %d asks for FTI's %s files: ftidask writes FTI-FF files (ckpt_io = 3) whatever ckpt_io "
            "says (FTI's POSIX, dCP and MPI-IO files are read with recover_file(path, meta=...))", cfg.ckpt_io,
            IO_MODES[cfg.ckpt_io])
    if comm is not None and client is not None:
        raise FTIError("pass comm= (MPI) or client= (Dask), not both")
    if comm is not None:
        return backend("mpi")(cfg, comm)
    if client is not None:
        return backend("dask")(cfg, client)
    from ..transport.base import SerialTransport

    return Context(cfg, SerialTransport())
