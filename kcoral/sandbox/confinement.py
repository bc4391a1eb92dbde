"""
A process that runs programs (a standalone server, a node's worker)
confines itself with its C{--sandbox} mode, after it listens and before
any thread starts (Landlock confines the thread that asks and those it
starts after, never one that already runs), in this order:

1. no_new_privs, which the next layers need;
2. no core dumps, and not dumpable;
3. every capability dropped (the bounding set first, then the others);
4. Landlock (L{kcoral.sandbox.policy});
5. seccomp (L{kcoral.sandbox.seccomp}), last: it refuses calls the steps
   before it make.

Its private temporary folder (L{kcoral.sandbox.tempfolder}) is made first.
C{auto} applies each layer the kernel offers and names the missing ones in
one log line; C{strict} applies all or exits (L{SandboxMissing}); C{off}
applies none and says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from twisted.logger import Logger

from kcoral.common.report import Sandbox
from kcoral.common.serverconfig import ServerConfig
from kcoral.sandbox import landlock, privileges, seccomp
from kcoral.sandbox.policy import Policy, policy_for
from kcoral.sandbox.tempfolder import private_temporary_folder

log = Logger()

#: What each Landlock ABI brings that the policy uses, beyond files.
LANDLOCK_FEATURES = ((landlock.TCP_ABI, "TCP ports"), (landlock.IOCTL_ABI, "device ioctls"),
                     (landlock.SCOPE_ABI, "signal and abstract socket scopes"))


class SandboxMissing(Exception):
    """C{--sandbox strict}, and a layer is missing: why, in one line."""


def confine(config: ServerConfig, *, environ: Mapping[str, str] = os.environ) -> Sandbox:
    """
    Confine this process as C{config.sandbox} says, and say what is on (as
    C{/health} does). L{SandboxMissing} in strict mode when a layer is
    missing; some layers may be on by then, and the process must exit.
    """
    mode = config.sandbox
    if mode == "off":
        log.warn("--sandbox off: programs run with every right of this process (its files, "
                 "its network, its user's other processes)")
        return current(mode, 0)
    started = time.perf_counter()
    policy = policy_for(config, environ=environ)
    missing = []
    try:
        # Made first: its remover's fork also ends the threads OpenBLAS
        # started as numpy was imported (kcoral.sandbox.tempfolder).
        policy = policy.with_read_write(private_temporary_folder())
    except OSError as e:
        missing.append(f"a private temporary folder ({e.strerror})")
    version = landlock.abi()
    threads = len(os.listdir("/proc/self/task"))
    missing += _landlock_missing(version, threads)
    unavailable = seccomp.available()
    if unavailable:
        missing.append(unavailable)
    if mode == "strict" and missing:
        raise SandboxMissing(f"--sandbox strict: missing {'; '.join(missing)}")
    steps = [("no_new_privs", privileges.no_new_privs), ("no core dumps", privileges.no_core_dumps),
             ("dropping capabilities", privileges.drop_capabilities)]
    landlocked = version > 0 and threads == 1
    if landlocked:
        steps.append(("Landlock", lambda: _landlock(policy, version)))
    if not unavailable:
        steps.append(("seccomp", lambda: seccomp.install(execute=policy.execute)))
    for name, step in steps:
        try:
            step()
        except OSError as e:
            if mode == "strict":
                raise SandboxMissing(f"--sandbox strict: {name} failed: {e.strerror}") from None
            missing.append(f"{name} ({e.strerror})")
            landlocked = landlocked and name != "Landlock"
    sandbox = current(mode, version if landlocked else 0)
    if missing:
        log.warn("sandbox {mode}: confined without {missing}", mode=mode,
                 missing="; ".join(missing))
    log.info("confined in {ms:.0f} ms: no_new_privs {nnp}, seccomp {seccomp}, Landlock ABI {abi}",
             ms=(time.perf_counter() - started) * 1e3, nnp=sandbox.no_new_privs,
             seccomp=sandbox.seccomp, abi=sandbox.landlock_abi)
    return sandbox


def _landlock_missing(version: int, threads: int) -> list[str]:
    """What of Landlock this process goes without."""
    if version == 0:
        return ["Landlock (not in this kernel)"]
    if threads > 1:
        return [f"Landlock ({threads} threads run already, which it would not confine)"]
    return [f"Landlock's {what} (ABI {needed}; this kernel's is {version})"
            for needed, what in LANDLOCK_FEATURES if version < needed]


def _landlock(policy: Policy, version: int) -> None:
    # A rule is made on what exists: the folders it may write are made now
    # (the service would make them at its first write).
    for path in policy.read_write:
        os.makedirs(path, exist_ok=True)
    landlock.restrict(version, policy.landlock_paths(), bind=policy.bind, connect=policy.connect)


def current(mode: str, landlock_abi: int) -> Sandbox:
    """What is on in this process: no_new_privs and seccomp as the kernel
    says them (C{/proc/self/status}), Landlock as applied (the kernel has
    no way to read it back)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return Sandbox(mode, fields.get("NoNewPrivs", "0").strip() == "1",
                   fields.get("Seccomp", "0").strip() == "2", landlock_abi)
