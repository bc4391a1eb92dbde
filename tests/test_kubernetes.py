"""
The Kubernetes deployment (C{deploy/kubernetes}) and its image (the
C{Containerfile}), checked offline with the real tools: C{kubectl kustomize}
renders the base and the CPU overlay, C{kubernetes-validate --strict}
validates every resource against Kubernetes' schemas, C{hadolint} lints the
Containerfile; then what the rendered manifests promise: stable Router names
that every node lists, node ids from the pod names, probes, the drain on
stop, tokens from the Secret.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from kcoral.common.serverconfig import ServerConfig
from kcoral.router.service import RouterConfig
from tests.tools import TOP, venv_tool

KUBERNETES = TOP / "deploy" / "kubernetes"
CONTAINERFILE = TOP / "Containerfile"
VARIANTS = {"base": KUBERNETES / "base", "cpu": KUBERNETES / "overlays" / "cpu"}
#: Seconds the probes give a node's first start (devices, CUDA libraries) at least.
STARTUP_SECONDS = 300


def render(variant: str) -> str:
    rendered = subprocess.run([venv_tool("kubectl"), "kustomize", str(VARIANTS[variant])],
                              capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    return rendered.stdout


def validate(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "rendered.yaml"
    path.write_text(text)
    return subprocess.run([venv_tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def resources(variant) -> dict[tuple[str, str], dict]:
    """A rendered variant's resources, by (kind, name)."""
    return {(r["kind"], r["metadata"]["name"]): r for r in yaml.safe_load_all(render(variant))}


def container(resources, statefulset: str) -> dict:
    return resources["StatefulSet", statefulset]["spec"]["template"]["spec"]["containers"][0]


def env(spec: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in spec.get("env", [])}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifests_render_and_validate(tmp_path, variant):
    """kubectl kustomize renders each variant, and kubernetes-validate --strict accepts all of it."""
    checked = validate(tmp_path, render(variant))
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_validation_speaks_up(tmp_path):
    """The check above can fail: --strict refuses a field no Kubernetes resource has."""
    text = render("base").replace("terminationGracePeriodSeconds:", "terminationGraceSeconds:", 1)
    assert validate(tmp_path, text).returncode != 0


def test_every_node_lists_every_router(resources):
    """Routers have stable names behind a headless Service, and the nodes list exactly those."""
    routers = resources["StatefulSet", "kcoral-router"]["spec"]
    headless = resources["Service", routers["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
    names = [f"http://kcoral-router-{i}.{routers['serviceName']}:9000" for i in range(routers["replicas"])]
    (config,) = (r for (kind, _), r in resources.items() if kind == "ConfigMap")
    assert config["data"]["KCORAL_ROUTER_ENDPOINT"].split(",") == names
    node = container(resources, "kcoral-node")
    assert node["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    assert resources["Service", "kcoral"]["spec"]["selector"] == routers["selector"]["matchLabels"]


def test_node_id_is_the_pod_name(resources):
    """A node's id is its pod's stable name, and it listens on (and advertises) the pod's address."""
    node = container(resources, "kcoral-node")
    variables = env(node)
    assert variables["KCORAL_NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert variables["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert node["args"][:3] == ["server", "--host", "$(POD_IP)"]


def test_gpus_requested_but_on_cpu_nodes(resources, variant):
    """The base's nodes each request a GPU; the CPU overlay's request none and run CPU workers."""
    node = container(resources, "kcoral-node")
    gpus = node["args"][node["args"].index("--gpus") + 1]
    if variant == "cpu":
        assert "nvidia.com/gpu" not in node["resources"].get("limits", {})
        assert (node["image"], gpus) == ("localhost/kcoral:cpu", "none")
        assert "--cpu-workers" in node["args"]
    else:
        assert node["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (node["image"], gpus) == ("localhost/kcoral:cuda12", "all")
    assert container(resources, "kcoral-router")["image"] == node["image"]


@pytest.mark.parametrize("statefulset, queue_wait", [
    ("kcoral-router", RouterConfig().queue_wait_timeout_seconds),
    ("kcoral-node", ServerConfig().queue_wait_timeout_seconds)])
def test_stopping_drains(resources, statefulset, queue_wait):
    """preStop lets endpoints update before SIGTERM; the grace outlasts it and a default queue wait."""
    pod = resources["StatefulSet", statefulset]["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5
    assert pod["terminationGracePeriodSeconds"] > pre_stop + queue_wait


def test_probes(resources):
    """Readiness is /readyz; a node's liveness is /health and its startup allows for a long first start."""
    router = container(resources, "kcoral-router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/readyz"
    node = container(resources, "kcoral-node")
    assert node["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert node["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = node["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_SECONDS


def test_tokens_come_from_the_secret(resources):
    """The node token (Routers and nodes) and the clients' tokens file come from the Secret kcoral-tokens."""
    for statefulset in ("kcoral-router", "kcoral-node"):
        token = env(container(resources, statefulset))["KCORAL_NODE_TOKEN"]["valueFrom"]
        assert token == {"secretKeyRef": {"name": "kcoral-tokens", "key": "node-token"}}
    router = container(resources, "kcoral-router")
    path = router["args"][router["args"].index("--client-tokens-file") + 1]
    (mount,) = (m for m in router["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    pod = resources["StatefulSet", "kcoral-router"]["spec"]["template"]["spec"]
    (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "kcoral-tokens"
    assert {"key": "client-tokens", "path": path.rpartition("/")[2]} in volume["secret"]["items"]


def hadolint(path) -> subprocess.CompletedProcess:
    return subprocess.run([venv_tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True)


def test_containerfile_lints_clean():
    """hadolint finds nothing to say about the Containerfile."""
    checked = hadolint(CONTAINERFILE)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_hadolint_speaks_up(tmp_path):
    """The check above can fail: hadolint objects to an image without a tag."""
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM python\nENTRYPOINT [\"kcoral\"]\n")
    assert "DL3006" in hadolint(bad).stdout


def test_one_image_for_every_service():
    """The image runs `kcoral` as a non-root user, stops with SIGTERM, checks /readyz, takes a JAX extra."""
    text = CONTAINERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["kcoral"\]$', text, re.MULTILINE)
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.MULTILINE)
    assert re.search(r"^HEALTHCHECK .*\n.*KCORAL_READYZ_URL", text, re.MULTILINE)
    assert "KCORAL_READYZ_URL=http://127.0.0.1:9000/readyz" in text
    assert re.search(r"^ARG JAX_EXTRA=cuda12$", text, re.MULTILINE)


def test_make_image_without_buildah():
    """make image, where buildah is missing, says so and fails."""
    made = subprocess.run(["make", "--no-print-directory", "image", "BUILDAH=kcoral-no-such-buildah"],
                          cwd=TOP, capture_output=True, text=True)
    assert made.returncode != 0
    assert "make image: kcoral-no-such-buildah is not installed" in made.stderr
