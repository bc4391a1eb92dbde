"""
The models one worker serves: every bundle folder of its model repository,
loaded onto its device and compiled for each batch size before the worker
says it is ready.

Everything here blocks (disk, hashing, JAX): a worker calls
L{ModelRepository.load} and L{LoadedModel.infer} from worker threads, never
from the reactor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs
import numpy as np
from twisted.logger import Logger

from kcoral.common.report import MAX_REASON, REPORTED_MODELS
from kcoral.models.bundle import Bundle, BundleError, read_bundle
from kcoral.models.manifest import MANIFEST, NAME, ModelManifest

log = Logger()

#: The most model folders a repository may hold.
MAX_MODELS = REPORTED_MODELS
READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
#: A model being loaded that was not served before: asked for, it is busy.
LOADING = "LOADING"
#: The reasons of a model the repository holds but does not serve.
NOT_LOADED = "not loaded"
UNLOADED = "unloaded"


class RepositoryError(Exception):
    """The model repository itself cannot be read: the worker cannot start."""


class UnknownModel(Exception):
    """No model of this name (or version) is in the repository."""

    def __init__(self, name: str, version: int | None = None):
        self.name = name
        self.version = version
        super().__init__(f"no model {name!r}" if version is None
                         else f"no version {version} of model {name!r}")


class ModelUnavailable(Exception):
    """The model is in the repository but is not served: its C{state}
    (UNAVAILABLE, or LOADING), and C{reason} says why."""

    def __init__(self, name: str, reason: str, state: str = UNAVAILABLE):
        self.name = name
        self.reason = reason
        self.state = state
        super().__init__(f"model {name!r} is {state.lower()}: {reason}")


@attrs.frozen
class ModelStatus:
    """One model of the repository index."""

    name: str
    version: int
    state: str
    reason: str = ""


@attrs.frozen
class LoadedModel:
    """A model ready to run: its params on the device, a compiled executable
    for each of its batch sizes (for size 0 when it is not batched)."""

    manifest: ModelManifest
    _params: tuple = attrs.field(repr=False)
    _executables: Mapping[int, Any] = attrs.field(repr=False)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs, by name in the manifest's order, of one request's
        C{inputs}; InvalidInput when they do not fit the model."""
        return self.run_batch(inputs, self.manifest.check(inputs))

    def run_batch(self, inputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """
        The outputs of C{rows} rows, their inputs already checked with
        C{manifest.check} (a batcher's requests concatenated): padded with
        zero rows up to the smallest compiled batch size that holds them, the
        padding's outputs dropped. A row's outputs do not depend on the other
        rows of its batch, as long as the model is row-wise.
        """
        if self.manifest.max_batch_size:
            size = self.manifest.batch_size_for(rows)
            arrays = [_padded(inputs[spec.name], size) for spec in self.manifest.inputs]
        else:
            # Not batched: one program, of the manifest's shapes, known as size 0.
            size, arrays = 0, [inputs[spec.name] for spec in self.manifest.inputs]
        outputs = self._executables[size](*self._params, *arrays)
        return {spec.name: np.asarray(output)[:rows] if size else np.asarray(output)
                for spec, output in zip(self.manifest.outputs, outputs)}


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    if len(array) == size:
        return array
    padded = np.zeros((size, *array.shape[1:]), array.dtype)
    padded[:len(array)] = array
    return padded


class ModelRepository:
    """
    The models in the folder C{path}: each folder directly in it that holds a
    C{model.json} is one, named after its folder. A model that cannot load is
    listed UNAVAILABLE with its reason; the others are served.

    C{observe_compile} is given the seconds of each compile.
    """

    def __init__(self, path: str | os.PathLike, *,
                 observe_compile: Callable[[float], None] = lambda seconds: None):
        self.path = os.fspath(path)
        self._observe_compile = observe_compile
        self._models: dict[str, LoadedModel | ModelStatus] = {}

    def load(self, device, only: Collection[str] | None = None) -> None:
        """
        Load every model (or those named in C{only}, the others listed as not
        loaded) onto the JAX C{device} and compile it for each of its batch
        sizes. Called once, before the worker says it is ready. A model that
        fails is UNAVAILABLE (and logged); a repository that cannot be
        listed raises L{RepositoryError}.
        """
        for name in self._folders():
            if only is None or name in only:
                self.load_model(name, device)
            else:
                self._settle(name, ModelStatus(name, 1, UNAVAILABLE, NOT_LOADED))

    def load_model(self, name: str, device) -> ModelStatus:
        """
        Load model C{name} (again) from its folder onto C{device}; its state
        after. A model served already is served until the new one is ready,
        and goes on being served if the new one fails.
        """
        platform = "cuda" if device.platform == "gpu" else device.platform
        served = self._models.get(name)
        version = 1
        try:
            bundle = read_bundle(os.path.join(self.path, name))
            version = bundle.manifest.version
            if not isinstance(served, LoadedModel):
                self._settle(name, ModelStatus(name, version, LOADING))
            loaded = self._load(name, bundle, device, platform)
        except Exception as e:
            # Out of device memory and compile errors alike: XLA raises
            # no class of its own for either.
            reason = (str(e) if isinstance(e, (BundleError, _Unavailable)) else (
                f"failed to load onto {platform}: {_first_line(e)}"))[:MAX_REASON]
            log.warn("model {name} is unavailable: {reason}", name=name, reason=reason)
            failed = ModelStatus(name, version, UNAVAILABLE, reason)
            if not isinstance(served, LoadedModel):
                self._settle(name, failed)
            return failed
        self._settle(name, loaded)
        log.info("model {name} is ready", name=name)
        return ModelStatus(name, loaded.manifest.version, READY)

    def unload_model(self, name: str) -> ModelStatus:
        """Stop serving model C{name} (requests running finish); its state after."""
        current = self._models.get(name)
        if current is None:
            raise UnknownModel(name)
        version = current.manifest.version if isinstance(current, LoadedModel) else current.version
        unloaded = ModelStatus(name, version, UNAVAILABLE, UNLOADED)
        self._settle(name, unloaded)
        log.info("model {name} is unloaded", name=name)
        return unloaded

    def forget(self, name: str) -> None:
        """Drop model C{name}, whose folder is gone, from the index."""
        self._models = {n: m for n, m in self._models.items() if n != name}
        log.info("model {name} left the repository", name=name)

    def stamps(self) -> dict[str, tuple[int, int]]:
        """Each model folder's manifest as last written (modified time and
        size): a model whose stamp changes was exported again."""
        stamps = {}
        for name in self._folders():
            try:
                found = os.stat(os.path.join(self.path, name, MANIFEST))
            except OSError:
                continue
            stamps[name] = (found.st_mtime_ns, found.st_size)
        return stamps

    def _settle(self, name: str, model: LoadedModel | ModelStatus) -> None:
        # Loading runs in a thread while the reactor lists the models: a new
        # mapping each time, never one changing under an iteration.
        self._models = {**self._models, name: model}

    def _folders(self) -> list[str]:
        try:
            with os.scandir(self.path) as entries:
                folders = sorted(entry.name for entry in entries if entry.is_dir()
                                 and os.path.isfile(os.path.join(entry.path, MANIFEST)))
        except OSError as e:
            raise RepositoryError(f"model repository {self.path}: {e.strerror}") from None
        named = []
        for name in folders:
            if NAME.match(name):
                named.append(name)
            else:
                log.warn("model folder {name!r} is not served: a model's name is 1-64 of "
                         "[A-Za-z0-9_.-]", name=name)
        if len(named) > MAX_MODELS:
            log.warn("the model repository holds {count} models: serving the first {most}",
                     count=len(named), most=MAX_MODELS)
        return named[:MAX_MODELS]

    def _load(self, name: str, bundle: Bundle, device, platform: str) -> LoadedModel:
        import jax
        from jax.sharding import SingleDeviceSharding

        manifest = bundle.manifest
        if manifest.name != name:
            raise _Unavailable(f"{MANIFEST} names the model {manifest.name!r}: a model's "
                               "folder has its name")
        if platform not in manifest.platforms:
            raise _Unavailable(f"exported for {', '.join(manifest.platforms)}, this worker "
                               f"runs {platform}: export it for {platform} too")
        params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in bundle.params]
        sharding = SingleDeviceSharding(device)
        executables = {}
        placed = tuple(jax.device_put(bundle.params, device))
        for program in manifest.programs:
            try:
                exported = jax.export.deserialize(bytearray(bundle.programs[program.file]))
            except Exception as e:
                raise _Unavailable(f"{program.file}: not a jax.export program: "
                                   f"{_first_line(e)}") from None
            _check_signature(program.file, exported, manifest, params)
            for size in program.batch_sizes or (0,):
                inputs = [jax.ShapeDtypeStruct((size, *spec.shape[1:]) if size else spec.shape,
                                               spec.dtype) for spec in manifest.inputs]
                started = time.perf_counter()
                executables[size] = jax.jit(exported.call, in_shardings=sharding).lower(
                    *params, *inputs).compile()
                self._observe_compile(time.perf_counter() - started)
        return LoadedModel(manifest, placed, executables)

    def index(self) -> list[ModelStatus]:
        """Every model and its state, in name order."""
        return [ModelStatus(name, model.manifest.version, READY)
                if isinstance(model, LoadedModel) else model
                for name, model in sorted(self._models.items())]

    def get(self, name: str, version: int | None = None) -> LoadedModel:
        """The model C{name} (at C{version}, when given) ready to run;
        L{UnknownModel} or L{ModelUnavailable} when it is not."""
        model = self._models.get(name)
        if model is None:
            raise UnknownModel(name)
        if isinstance(model, ModelStatus):
            raise ModelUnavailable(name, model.reason, model.state)
        if version is not None and version != model.manifest.version:
            raise UnknownModel(name, version)
        return model


class _Unavailable(Exception):
    """A model that cannot be served; the message says why."""


def _check_signature(file: str, exported, manifest: ModelManifest, params: list) -> None:
    """Check that the program on one device takes the params then the inputs
    that the manifest describes, and returns its outputs."""
    if exported.nr_devices != 1:
        raise _Unavailable(f"{file}: exported for {exported.nr_devices} devices; a model runs on one")
    takes = [(p.dtype, p.shape) for p in params] + [(s.dtype, s.shape) for s in manifest.inputs]
    returns = [(s.dtype, s.shape) for s in manifest.outputs]
    for what, avals, described in (("takes", exported.in_avals, takes),
                                   ("returns", exported.out_avals, returns)):
        actual = [(aval.dtype, tuple(d if isinstance(d, int) else -1 for d in aval.shape))
                  for aval in avals]
        # A program for one batch size has that size where the manifest has -1.
        if len(actual) != len(described) or any(
                dtype != want or len(shape) != len(wanted) or any(
                    w != -1 and d != w for d, w in zip(shape, wanted))
                for (dtype, shape), (want, wanted) in zip(actual, described)):
            raise _Unavailable(f"{file} {what} {_signature(actual)}; the params and "
                               f"{MANIFEST} say {_signature(described)}")


def _signature(arrays) -> str:
    return ", ".join(f"{np.dtype(dtype)}{list(shape)}" for dtype, shape in arrays) or "nothing"


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:500]
