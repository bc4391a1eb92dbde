"""
How many JAX devices the host's CPU is split into: a worker that owns
several host devices (and the tests that shard programs themselves) set
this XLA flag before JAX starts.
"""

from __future__ import annotations

#: The XLA flag that splits the host's CPU into several JAX devices.
HOST_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def host_device_flags(flags: str, count: int) -> str:
    """C{flags} (an C{XLA_FLAGS} value) with the host platform split into
    C{count} devices, any count it named before replaced."""
    kept = [f for f in flags.split() if f.split("=", 1)[0] != HOST_DEVICE_COUNT]
    return " ".join([*kept, f"{HOST_DEVICE_COUNT}={count}"])
