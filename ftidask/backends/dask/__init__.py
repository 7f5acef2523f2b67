"""The Dask backend's parts: pure planning (:mod:`.plan`), the functions that run as tasks on
the workers (:mod:`.tasks`), and recovery planning (:mod:`.restore`).

Only :mod:`ftidask.backends.dask.context` and this package import ``distributed``; :mod:`.plan` and
:mod:`.tasks` do not (the tasks are plain functions that Dask ships to the workers).
"""
