"""
What a node's worker keeps of the node's environment: an allow-list.

A worker runs the programs clients send, and a program that took the
process over could read whatever its environment holds. The node's
environment is where operators put the node's tokens (C{KCORAL_NODE_TOKEN}
would let it register workers with the Router, and so receive other
clients' programs and inputs) and their own cloud credentials. A worker
needs none of them: it gets what Python, JAX and XLA, CUDA, the C library
(locale, time zone) and the numeric libraries read, KCoral's own variables
but the node's settings, and the names given with C{--worker-env}. A name
that looks like a credential never passes, even under a prefix the list
takes (C{OTEL_EXPORTER_OTLP_HEADERS} carries a collector's API key), and
C{--worker-env} cannot ask for one.

A node's front processes are not workers (they run no programs): they keep
the node's environment (L{kcoral.node.front}).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from kcoral.common.announce import URL_FD_ENV
from kcoral.logs import CHILD_ENV
from kcoral.node.devices import NODE_DEVICES_ENV
from kcoral.web.auth import CLIENT_TOKEN_ENV

#: Set by a supervisor whose node has a node token, for its workers, which
#: never get the token itself: a worker counts as secured where its node
#: does (its listener's warning about a public address, kcoral.web.listener).
SECURED_ENV = "KCORAL_NODE_SECURED"

#: Variables passed by their whole name.
NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "GLIBC_TUNABLES", "XDG_CACHE_HOME",
    # CA bundles a worker's outgoing TLS reads (an OpenTelemetry collector's).
    "SSL_CERT_FILE", "SSL_CERT_DIR",
})
#: Variables passed by their prefix: the C library's locale, Python, JAX and
#: XLA (with TensorFlow's logging, which XLA's C++ reads), the PJRT plugins,
#: CUDA and its libraries, the BLAS and OpenMP runtimes, OpenTelemetry, and
#: KCoral's own.
PREFIXES = ("LC_", "PYTHON", "JAX_", "XLA_", "TF_CPP_", "PJRT_", "CUDA_", "CUDNN_", "NVIDIA_",
            "NCCL_", "OPENBLAS_", "OMP_", "KMP_", "MKL_", "MALLOC_", "OTEL_", "KCORAL_")
#: KCoral's variables a worker never inherits: the node's settings (a worker
#: given C{KCORAL_ROUTER_ENDPOINT} and C{KCORAL_NODE_ID} would be a node
#: itself, and start workers of its own), its tokens, and the marks its
#: supervisor sets itself.
WITHHELD = frozenset({"KCORAL_ROUTER_ENDPOINT", "KCORAL_NODE_ID", "KCORAL_NODE_TOKEN",
                      CLIENT_TOKEN_ENV, *NODE_DEVICES_ENV.values(), CHILD_ENV, URL_FD_ENV,
                      SECURED_ENV})

#: What a credential's name holds, whatever its case: its kind
#: (C{GITHUB_TOKEN}, C{DB_PASSWORD}, C{OPENAI_API_KEY}, C{AWS_SECRET_ACCESS_KEY}),
#: or an HTTP header or cookie that carries one.
_CREDENTIAL_WORDS = re.compile(
    r"TOKEN|SECRET|PASSW|PASSPHRASE|KEY|CREDENTIAL|AUTH|COOKIE|HEADER|PRIVATE|SESSION|SIGNATURE")
#: The providers whose every variable is taken for a credential (a profile,
#: a file of keys, an account).
_CREDENTIAL_PREFIXES = ("AWS_", "AMAZON_", "GOOGLE_", "GCLOUD_", "GCP_", "AZURE_")
#: A variable's name as a shell writes it.
_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")


def credential(name: str) -> bool:
    """Whether the variable C{name} may hold a credential."""
    upper = name.upper()
    return upper.startswith(_CREDENTIAL_PREFIXES) or _CREDENTIAL_WORDS.search(upper) is not None


def allowed(name: str) -> bool:
    """Whether a worker gets the node's variable C{name} without being told to."""
    return (name in NAMES or name.startswith(PREFIXES)) and name not in WITHHELD \
        and not credential(name)


def refusal(name: str) -> str | None:
    """Why C{--worker-env NAME} cannot pass C{name} to a worker (None: it can)."""
    if credential(name):
        return f"{name!r} may hold a credential, which a worker never gets"
    if name in WITHHELD:
        return f"{name} is the node's own, which a worker never gets"
    if not _NAME.match(name):
        return f"{name!r} is not a variable's name"
    return None


@attrs.frozen
class WorkerEnvironment:
    """The variables of a node's environment its workers get: the
    allow-list's and those named in C{extra} (refused with a ValueError
    when one may not pass, L{refusal})."""

    extra: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name in self.extra:
            why = refusal(name)
            if why is not None:
                raise ValueError(f"--worker-env: {why}")

    def of(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The part of C{environ} a worker gets."""
        return {name: value for name, value in environ.items()
                if allowed(name) or name in self.extra}
