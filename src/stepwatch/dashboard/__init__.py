"""The local web dashboard on a run store: ``stepwatch serve`` or :func:`serve`.

It imports no PyTorch and reads only through :class:`stepwatch.store.Store`.
"""

from .server import DashboardServer, make_server, serve

__all__ = ["DashboardServer", "make_server", "serve"]
