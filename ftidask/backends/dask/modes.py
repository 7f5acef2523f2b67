"""The modes of the files a Dask worker creates (``[advanced] permissions``), on every worker, also those joining later.

A context sets them in its own process; the workers write the rank files. Set once on the workers alive at ``init``,
a worker that joined later (one restarted after it was lost) kept the default private modes: its node's next
checkpoint files were 0600 where the others' were 0640 with ``permissions = group``. The setting is kept in the
scheduler's metadata, and a worker plugin (set up on every worker the cluster ever has, as the L2/L3 channel's) reads
it when a worker joins. The plugin is idempotent, so only the first ``init`` on a cluster broadcasts it (a worker the
scheduler still lists but that just died fails that broadcast, as the L2/L3 channel's); the live workers get each
later setting from a call that passes a dead worker over.
"""

from __future__ import annotations

from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from ...storage import files as storage
from .cluster import Cluster

NAME = "ftidask-permissions"
KEY = ["ftidask", "permissions"]  # scheduler metadata: the last context's setting


class PermissionsPlugin(WorkerPlugin):
    """Gives every worker that joins the modes of the setting in the scheduler's metadata."""

    name = NAME
    idempotent = True

    async def setup(self, worker: Any) -> None:
        """Files and directories ``worker`` creates from now on get the modes of the run's setting."""
        value = await worker.scheduler.get_metadata(keys=KEY, default="private")
        storage.set_permissions(value if value in storage.PERMISSIONS else "private")


def register(client: Client, cluster: Cluster, permissions: str) -> None:
    """Set ``permissions`` on every live worker now, and on every worker that joins later."""
    client.set_metadata(KEY, permissions)
    cluster.run(storage.set_permissions, permissions)
    client.register_plugin(PermissionsPlugin(), name=NAME)
