"""
Mutual TLS (C{--tls-client-ca}), with CAs generated in the test
(L{tests.tlsutil}): a Router and a standalone server admit a client that
presents a certificate from that CA, and refuse, in the handshake, one that
presents none or one from another CA; a client token is still needed on top.
A node's supervisor presents its own certificate to such a Router, which
verifies the node's https workers as before (L{tests.test_tls}).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from kcoral import AsyncClient, Client
from kcoral.errors import NodeFailure, Unauthorized
from kcoral.web.endpoint import tls_options
from tests.harness import until
from tests.test_auth import TOKEN, quick_program
from tests.test_routed import start_node, start_router
from tests.test_tls import http_get
from tests.tlsutil import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The deployment's CA (a service's and a client's certificates) and another CA's client."""
    base = tmp_path_factory.mktemp("mtls")
    good = TestCA(base / "good", "KCoral deployment CA")
    other = TestCA(base / "other", "Some other CA")
    return {"ca": good, "service": good.issue("service"), "node": good.issue("node", client=True),
            "client": good.issue("client", dns=("alice",), ips=(), client=True),
            "stranger": other.issue("stranger", dns=("mallory",), ips=(), client=True)}


def mtls_options(pki) -> list[str]:
    return [*pki["service"].options(), "--tls-client-ca", pki["ca"].path]


def contexts(pki) -> dict:
    """Client contexts that trust the service, presenting each kind of certificate."""
    ca = pki["ca"]
    return {"ours": ca.client_context(pki["client"]), "none": ca.client_context(),
            "another CA's": ca.client_context(pki["stranger"])}


def get_health(url: str, context):
    """/health's status code, or the error the connection ended with."""
    try:
        return http_get(url, "/health", context)[0]
    except OSError as e:  # ssl.SSLError, a reset: the handshake was refused
        return e


def test_a_client_ca_makes_the_handshake_ask_for_a_certificate(pki):
    """With a client CA, the TLS options verify the peer and require its certificate."""
    from OpenSSL import SSL

    context = tls_options(pki["service"].cert, pki["service"].key, pki["ca"].path).getContext()
    assert context.get_verify_mode() & SSL.VERIFY_PEER
    assert context.get_verify_mode() & SSL.VERIFY_FAIL_IF_NO_PEER_CERT
    plain = tls_options(pki["service"].cert, pki["service"].key).getContext()
    assert plain.get_verify_mode() == SSL.VERIFY_NONE


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_router_admits_only_clients_with_a_certificate_from_its_ca(processes, pki):
    """A Router with --tls-client-ca serves a client and a node with our certificates, and no other."""
    ca = pki["ca"]
    router = await start_router(processes, *mtls_options(pki), "--tls-ca", ca.path,
                                name="mtls-router")
    assert router.url.startswith("https://")
    for name, context in contexts(pki).items():
        answer = await deferToThread(get_health, router.url, context)
        if name == "ours":
            assert answer == 503, answer  # served: no node yet
        else:
            assert isinstance(answer, OSError), (name, answer)

    # The supervisor presents the node's certificate; the Router verifies the https worker.
    await start_node(processes, router.url, "mtls-node", *pki["node"].options(), "--tls-ca", ca.path)
    ours = contexts(pki)["ours"]

    async def ready():
        return await deferToThread(get_health, router.url, ours) == 200

    await until(ready, "mtls-node ready", 60, 0.2)
    client = AsyncClient(router.url, tls_ca=ca.path, tls_client_cert=pki["client"].cert,
                         tls_client_key=pki["client"].key)
    x = np.arange(3, dtype=np.float32)
    try:
        np.testing.assert_allclose(await client.run(quick_program(), x), x * 2 - 1)
    finally:
        await client.close()
    assert router.process.running
    assert "Traceback" not in "\n".join(router.process.output.lines)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_standalone_server_with_mtls_and_a_token(start_server, pki):
    """A server with a client CA and a token runs for a client with both, refuses one lacking either."""
    server = await start_server(*mtls_options(pki), "--client-token", TOKEN, name="mtls-server")
    x = np.arange(3, dtype=np.float32)
    context = contexts(pki)

    def run(which: str, token: str | None):
        try:
            with Client(server.url, ssl_context=context[which], token=token) as client:
                return client.run(quick_program(), x, request_id="mtls-run")
        except (NodeFailure, Unauthorized) as e:
            return e

    np.testing.assert_allclose(await deferToThread(run, "ours", TOKEN), x * 2 - 1)
    assert isinstance(await deferToThread(run, "ours", None), Unauthorized)
    for which in ["none", "another CA's"]:
        refused = await deferToThread(run, which, TOKEN)
        assert isinstance(refused, NodeFailure) and re.search(r"connection .* failed", str(refused))
    assert TOKEN not in "\n".join(server.process.output.lines)
