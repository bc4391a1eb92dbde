"""
How a process that runs clients' programs confines itself: a node's workers
and a standalone server (L{kcoral.sandbox.confinement}).
"""

from kcoral.common.serverconfig import SANDBOX_MODES

__all__ = ["SANDBOX_MODES"]
