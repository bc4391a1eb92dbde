"""
What a KCoral connection and its requests read from the site that made
them: the one seam between L{kcoral.web.site} and the channel and request
it builds, so that neither imports the other.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IKCoralSite(Interface):
    """A site's settings and shared state, as its connections use them."""

    bounds = Attribute("The body's bounds (kcoral.web.bounds.BodyBounds).")
    spool = Attribute("Where large bodies go (kcoral.web.spool.Spool), or None.")
    streams = Attribute("Whether a request (method, path) whose body is spooled is processed "
                        "while its body arrives.")
    client_guard = Attribute("The client tokens guarded paths need (IGuard), or None.")
    clock = Attribute("The reactor's clock (IReactorTime).")
    logger = Attribute("The service's twisted.logger Logger.")
    metrics = Attribute("The service's HTTP metrics (kcoral.metrics.HttpMetrics).")
    header_timeout = Attribute("Seconds each request head may take.")
    keepalive = Attribute("How the kernel probes each connection for a silent peer "
                          "(kcoral.common.keepalive.Keepalive).")
    connections = Attribute("The open connections (kcoral.web.connections.Connections).")
    closing = Attribute("True once every answer closes its connection.")
