"""
How a process that runs clients' programs confines itself: a node's workers
and a standalone server.
"""

#: C{--sandbox}: every layer the kernel offers (the missing ones logged),
#: every layer or exit 2, or none.
SANDBOX_MODES = ("auto", "strict", "off")
