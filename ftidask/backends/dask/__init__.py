"""The Dask backend's parts: pure planning (:mod:`.plan`), the functions that run as tasks on
the workers (:mod:`.tasks`), recovery planning (:mod:`.restore`), and the L2/L3 levels: the
shared level code run one task per worker (:mod:`.group_tasks`, placed by :mod:`.group_steps`)
over worker-to-worker channels (:mod:`.channel`).

Only :mod:`ftidask.backends.dask.context` and this package import ``distributed``; :mod:`.plan` and
:mod:`.tasks` do not (the tasks are plain functions that Dask ships to the workers).
"""
