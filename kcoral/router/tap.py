"""
C{twistd kcoral-router} and C{kcoral router}: one C{usage.Options}, one
C{makeService}.
"""

from __future__ import annotations

from kcoral.options import LISTEN, KCoralOptions, check_listen, non_negative, port, positive


class Options(KCoralOptions):
    synopsis = "[options]"
    longdesc = ("Run a KCoral Router: one stable address that sends each program to a "
                "healthy node with free capacity, queueing when none is free.")

    optParameters = [
        ["host", None, "127.0.0.1", "Interface to listen on."],
        ["port", None, 9000, "Port to listen on.", port],
        ["status-check-interval-seconds", None, 1.0, "Interval for checking status freshness.", positive(float)],
        ["max-status-age-seconds", None, 5.0, "Maximum age of a node health report.", positive(float)],
        ["unhealthy-threshold", None, 3, "Failed observations before removing a ready node.", positive(int)],
        ["recovery-threshold", None, 2, "Successful observations before a failed node returns.", positive(int)],
        ["queue-wait-timeout-seconds", None, 1800.0, "Maximum wait for capacity.", non_negative(float)],
        ["max-queued-requests", None, 1024, "Bound on requests waiting for capacity.", non_negative(int)],
        ["node-retention-seconds", None, 600.0, "Retention of disconnected, unused node records.", non_negative(float)],
        ["max-request-bytes", None, 268435456, "Maximum accepted request body size, in bytes.", positive(int)],
        ["node-token", None, None, "Token nodes must present [env: KCORAL_NODE_TOKEN]."],
        ["tls-cert", None, None, "PEM certificate (chain): listen with TLS."],
        ["tls-key", None, None, "PEM private key of --tls-cert (default: inside --tls-cert)."],
        ["tls-ca", None, None, "PEM CA to verify https peers with (default: the system's roots)."],
        LISTEN,
    ]
    environment = {"node-token": "KCORAL_NODE_TOKEN"}

    def postOptions(self):
        super().postOptions()
        check_listen(self)

    def router_config(self):
        from kcoral.router.service import RouterConfig

        return RouterConfig(
            host=self["host"], port=self["port"],
            status_check_interval_seconds=self["status-check-interval-seconds"],
            max_status_age_seconds=self["max-status-age-seconds"],
            unhealthy_threshold=self["unhealthy-threshold"],
            recovery_threshold=self["recovery-threshold"],
            queue_wait_timeout_seconds=self["queue-wait-timeout-seconds"],
            max_queued_requests=self["max-queued-requests"],
            node_retention_seconds=self["node-retention-seconds"],
            max_request_bytes=self["max-request-bytes"],
            node_token=self["node-token"],
            tls_cert=self["tls-cert"], tls_key=self["tls-key"], tls_ca=self["tls-ca"],
            listen=self["listen"],
        )


def makeService(options: Options, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    from kcoral.router.service import RouterService

    return RouterService(options.router_config(), reactor)
