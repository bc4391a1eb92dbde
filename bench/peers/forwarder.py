"""
A TCP forwarder for the chaos run (``bench.chaos``): every connection it
accepts on its port it joins to a new one to the target port, passing bytes
both ways (Twisted's ``portforward``).

    python -m bench.peers.forwarder LISTEN_PORT TARGET_PORT

It stands on the path from a node to one Router. Stopped with SIGSTOP, it
passes nothing while the kernel still accepts connections on its port: a
link that silently stops delivering (no reset, no refusal), which only
timeouts notice. SIGCONT resumes it; SIGTERM ends it with status 0.
"""

import sys

from twisted.internet import reactor
from twisted.protocols.portforward import ProxyFactory


def main(listen: int, target: int) -> None:
    port = reactor.listenTCP(listen, ProxyFactory("127.0.0.1", target), interface="127.0.0.1")
    print(f"forwarding 127.0.0.1:{port.getHost().port} to 127.0.0.1:{target}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
