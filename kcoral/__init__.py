"""
KCoral: run exported JAX programs on a changing pool of GPU machines through
one stable address.

The Router and the node supervisor never import JAX, so the client API is
loaded on first use.
"""

from kcoral._version import __version__
from kcoral.errors import (
    ArrayLost,
    BadRequest,
    KCoralError,
    NodeFailure,
    NotFound,
    ProgramExportError,
    ProgramFailed,
    ProgramRejected,
    RunTimeout,
    ServerBusy,
)

__all__ = ["ArrayLost", "AsyncClient", "BadRequest", "Client", "KCoralError", "NodeFailure",
           "NotFound", "Program", "ProgramExportError", "ProgramFailed", "ProgramRejected", "RemoteArray",
           "RunTimeout", "ServerBusy", "Strings", "__version__", "export_bundle"]


def __getattr__(name: str):
    if name == "Client":
        from kcoral.client.sync import Client
        return Client
    if name == "AsyncClient":
        from kcoral.client.asynchronous import AsyncClient
        return AsyncClient
    if name == "RemoteArray":
        from kcoral.client.remote import RemoteArray
        return RemoteArray
    if name == "Program":
        from kcoral.program import Program
        return Program
    if name == "Strings":
        from kcoral.protocol.strings import Strings
        return Strings
    if name == "export_bundle":
        from kcoral.models.bundle import export_bundle
        return export_bundle
    raise AttributeError(f"module 'kcoral' has no attribute {name!r}")
