# The two commands a new machine needs: `make demo` and `make test`; `make lint`
# checks style and types, `make docs` builds the documentation site.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The site needs Sphinx, not JAX: its own extra, in the same venv.
DOCS_STAMP := $(VENV)/.docs-stamp

.PHONY: demo test test-slow test-twisted-next hosts-tools lint docs install bench clean

$(STAMP): EXTRAS = jax,test,lint
$(DOCS_STAMP): EXTRAS = docs
$(STAMP) $(DOCS_STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[$(EXTRAS)]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite in two parts, so that the first stays under fifteen minutes on two
# cores: `make test` runs every case but those marked slow, `make test-slow`
# runs those (long chaos, benchmark and recovery cases); CI runs both.
test: $(STAMP) hosts-tools
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP) hosts-tools
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The test hosts of the runs of faults between hosts (bench.support.hosts: network
# namespaces) need iproute2 and nftables, installed here where root lacks them;
# without root those tests skip, saying so.
hosts-tools:
	@if [ "$$(id -u)" = 0 ]; then $(call require,ip,iproute2); $(call require,nft,nftables); fi

# The newest Twisted release on the package index, whatever pyproject.toml
# pins, laid over .venv in $(TWISTED_NEXT) without changing .venv, under the
# contract tests of Twisted's seams (tests/test_seams.py) and the web tests
# (TWISTED_NEXT_TESTS='-m "not slow"': the whole suite). Raising the pin is
# decided on what this shows; CI does not run it (doc/operations.rst).
TWISTED_NEXT := .twisted-next
TWISTED_NEXT_TESTS ?= tests/test_seams.py tests/test_site.py tests/test_spool.py tests/test_sendnow.py \
  tests/test_http.py tests/test_front_door.py tests/test_attacks.py tests/test_hostile.py \
  tests/test_server.py tests/test_keepalive.py tests/test_tls.py
test-twisted-next: $(STAMP)
	$(PY) -m tests.twisted_next $(TWISTED_NEXT)
	PYTHONPATH=$(CURDIR)/$(TWISTED_NEXT) $(PY) -c \
	  'import twisted; print("make test-twisted-next: Twisted", twisted.__version__, "from", twisted.__file__)'
	PYTHONPATH=$(CURDIR)/$(TWISTED_NEXT) $(PY) -m pytest $(TWISTED_NEXT_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# Warnings are errors, references are checked (-n), and nothing is fetched.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -b html doc doc/_build/html

# Every benchmark's quick form (python -m bench.NAME --quick: seconds of the
# same run, to show it works, not how fast), one after another, on the CPU; a
# failed one is named at the end and the target fails. What a benchmark needs
# beyond the venv, where this machine lacks it, is said in a "skipped" line,
# never left out silently: HAProxy and wrk (compare, large, affinity, fleet;
# compare also unshare, nsenter and ss), root for network namespaces
# (netfaults; hosts-tools installs ip and nft), valgrind (instructions), a GPU
# (cudashm_check, the CUDA shared memory check). The peers fetched from PyPI on first use are left out
# of every quick run, saying so: Ray Serve (compare: --paths without ray-*)
# and PyTriton, KServe and perf_analyzer (serving: KCoral and the floor under
# its own load). large runs its 16 MiB and 5 ms bodies at one connection.
bench: $(STAMP) hosts-tools
	@failed=; \
	run() { echo "== python -m bench.$$*"; started=$$(date +%s); \
	  $(PY) -m bench."$$@" || failed="$$failed $$1"; echo "== bench.$$1: $$(($$(date +%s) - started)) s"; }; \
	skip() { echo "== bench.$$1: skipped, $$2"; }; \
	have() { for tool; do command -v $$tool >/dev/null 2>&1 || return 1; done; }; \
	for name in server router routing node pool programcheck kept_request shm decode training sequence chaos; do \
	  run $$name --quick; done; \
	echo "== bench.serving: Triton, KServe and perf_analyzer left out (fetched from PyPI)"; \
	run serving --quick --fronts kcoral,floor --load loop; \
	if have haproxy wrk unshare nsenter ss; then \
	  echo "== bench.compare: Ray Serve left out (fetched from PyPI)"; \
	  run compare --quick --paths direct,router,haproxy --bare; \
	  run large --quick --bare --programs 16mib,5ms --connections 1; \
	else skip compare "needs haproxy, wrk, unshare, nsenter and ss"; skip large "needs haproxy and wrk"; fi; \
	if have haproxy; then run affinity --quick; run fleet --quick; \
	else skip affinity "needs haproxy"; skip fleet "needs haproxy"; fi; \
	if [ "$$(id -u)" = 0 ]; then run netfaults --quick; \
	else skip netfaults "needs root (network namespaces)"; fi; \
	if have valgrind; then run instructions --quick; \
	else skip instructions "needs valgrind"; fi; \
	if have nvidia-smi; then run cudashm_check --gpus 0; \
	else skip cudashm_check "needs an NVIDIA GPU (no nvidia-smi)"; fi; \
	[ -z "$$failed" ] || { echo "make bench: failed:$$failed" >&2; exit 1; }

clean:
	rm -rf $(VENV) $(TWISTED_NEXT) build *.egg-info .pytest_cache .mypy_cache .ruff_cache doc/_build

# The container image of the Router and the nodes (Containerfile), with
# buildah: `make image` for CUDA 12, `make image JAX_EXTRA=cpu` for the CPU.
# Where no container registry is reachable, `make base-image` first makes a
# Debian base from Debian's package repositories, which `make image` then
# builds on (BASE names another). `make test-image` builds the CPU image and
# runs it with podman (tests/image), then removes it unless KEEP_IMAGE=1.
# Each target installs Debian's packages it needs where they are missing.
BUILDAH ?= buildah
PODMAN ?= podman
JAX_EXTRA ?= cuda12
IMAGE ?= localhost/kcoral
DEBIAN_SUITE ?= bookworm
BASE_IMAGE ?= localhost/debian:$(DEBIAN_SUITE)
# Expanded when `make image` runs, after a `make base-image` before it.
BASE ?= $(shell $(PODMAN) image exists $(BASE_IMAGE) 2>/dev/null && echo $(BASE_IMAGE))
# The engines' settings (the runtime, limits) from the repository, not /etc.
CONTAINERS_CONF ?= $(CURDIR)/deploy/containers.conf
export CONTAINERS_CONF
# The CAs this host trusts (a TLS-inspecting proxy's among them, where there
# is one) for the build's pip: mounted into its steps, never saved in the image.
HOST_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
.PHONY: base-image image test-image

# $(call require,COMMAND,PACKAGES): Debian's PACKAGES installed (as root)
# where COMMAND is missing; the target fails, saying so, if it still is.
define require
command -v $(1) >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || { \
  export DEBIAN_FRONTEND=noninteractive; \
  apt-get -o DPkg::Lock::Timeout=600 install -y $(2) >/dev/null 2>&1 \
  || { apt-get update >/dev/null && apt-get -o DPkg::Lock::Timeout=600 install -y $(2) >/dev/null; }; }; \
command -v $(1) >/dev/null 2>&1 || { \
  echo "make $@: $(1) is not installed (Debian: apt-get install $(2))" >&2; exit 1; }
endef

# Debian's Python (3.11 in bookworm) and the CAs; dpkg leaves out the
# documentation but its copyright files, and mmdebstrap the package lists.
base-image:
	@$(call require,mmdebstrap,mmdebstrap)
	@$(call require,$(PODMAN),podman runc)
	rootfs=$$(mktemp -d) && trap 'rm -rf "$$rootfs"' EXIT && \
	mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
	  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
	  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
	  $(DEBIAN_SUITE) "$$rootfs/rootfs.tar" && \
	$(PODMAN) import "$$rootfs/rootfs.tar" $(BASE_IMAGE)

# --format docker: OCI images have no HEALTHCHECK.
image:
	@$(call require,$(BUILDAH),buildah runc)
	$(BUILDAH) build --format docker --build-arg JAX_EXTRA=$(JAX_EXTRA) \
	  $(if $(BASE),--build-arg BASE=$(BASE)) \
	  $(if $(HOST_CA),--volume $(HOST_CA):/etc/ssl/certs/ca-certificates.crt:ro) \
	  --tag $(IMAGE):$(JAX_EXTRA) --file Containerfile .

# Runs after `make test`, in the same virtualenv: the tests drive podman and
# compare the image's answers with JAX here. On a machine that has neither a
# base image of its own nor a registry, BASE=$(BASE_IMAGE) is made first.
test-image: $(STAMP)
	@$(call require,$(PODMAN),podman runc)
	$(PODMAN) image exists $(BASE_IMAGE) || $(MAKE) base-image
	$(MAKE) image JAX_EXTRA=cpu
	status=0; KCORAL_IMAGE=$(IMAGE):cpu PODMAN=$(PODMAN) \
	  $(PY) -m pytest tests/image $(PYTEST_ARGS) || status=$$?; \
	[ "$(KEEP_IMAGE)" = 1 ] || $(PODMAN) rmi --force $(IMAGE):cpu >/dev/null || status=1; \
	exit $$status

# The wheels bench/gpu_check.sh installs on a GPU machine that reaches no
# package index (into .whl/, for Python 3.12 on x86-64); for this machine's
# Python, to rehearse: make gpu-carry GPU_CARRY_ARGS="--python-version 3.11 --glibc 2.36"
.PHONY: gpu-carry
gpu-carry:
	$(PYTHON) -m bench.gpu_carry prepare $(GPU_CARRY_ARGS)
