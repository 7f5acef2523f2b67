"""The backends that are not a single process: MPI ranks (``mpi``) and Dask workers (``dask``).

Only ``backends.mpi`` imports mpi4py and only ``backends.dask`` imports dask and distributed.
"""
