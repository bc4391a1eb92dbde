"""
How many connections a service accepts: fewer than the file descriptors the
process may open, so that clients never take them all.

Why: Twisted's port survives running out (on EMFILE it accepts and closes
with a descriptor it keeps in reserve), but the rest of the process does
not: a Router with every descriptor held by clients cannot open a
connection to a worker (a run through it was answered 500 in
C{tests/test_hostile.py}), a server cannot open its disk cache, a
supervisor cannot probe. With a cap below the limit, a connection beyond
it is accepted and closed at once (L{kcoral.web.site.KCoralSite}), and
everything else keeps its descriptors.
"""

from __future__ import annotations

import resource

#: Descriptors kept for everything but client connections (cache files,
#: probes, JAX's own), at most half of the limit. A Router also keeps one for
#: each run it may have in flight (L{kcoral.router.service}).
RESERVED = 256
#: The soft limit is raised towards the hard one, up to this.
WANTED = 65536


def connection_limit(kept: int = 0) -> int:
    """Raise this process's soft limit on open files as far as allowed (up
    to L{WANTED}), and return how many client connections may be open,
    leaving out besides the reserve the C{kept} descriptors that clients may
    have it hold open otherwise (their shared-memory regions)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED if hard == resource.RLIM_INFINITY else min(hard, WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = WANTED
    return soft - min(RESERVED + kept, soft // 2)
