# The two commands a new machine needs: `make demo` and `make test`; `make lint`
# checks style and types, `make docs` builds the documentation site.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The site needs Sphinx, not JAX: its own extra, in the same venv.
DOCS_STAMP := $(VENV)/.docs-stamp

.PHONY: demo test lint docs install bench clean

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

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# Warnings are errors, references are checked (-n), and nothing is fetched.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -b html doc doc/_build/html

bench: $(STAMP)
	$(PY) bench/server.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache doc/_build

# The container image of the Router and the nodes (Containerfile), with
# buildah: `make image` for CUDA 12, `make image JAX_EXTRA=cpu` for the CPU.
# --format docker: OCI images have no HEALTHCHECK.
BUILDAH ?= buildah
JAX_EXTRA ?= cuda12
IMAGE ?= localhost/kcoral
.PHONY: image
image:
	@command -v $(BUILDAH) >/dev/null 2>&1 || { \
	  echo "make image: $(BUILDAH) is not installed (Debian: apt-get install buildah)" >&2; exit 1; }
	$(BUILDAH) build --format docker --build-arg JAX_EXTRA=$(JAX_EXTRA) \
	  --tag $(IMAGE):$(JAX_EXTRA) --file Containerfile .

# The wheels bench/gpu_check.sh installs on a GPU machine that reaches no
# package index (into .whl/, for Python 3.12 on x86-64); for this machine's
# Python, to rehearse: make gpu-carry GPU_CARRY_ARGS="--python-version 3.11 --glibc 2.36"
.PHONY: gpu-carry
gpu-carry:
	$(PYTHON) bench/gpu_carry.py prepare $(GPU_CARRY_ARGS)
