"""
The models one worker serves: every bundle folder of its model repository,
loaded onto its device and compiled for each batch size (or, batch
invariant, once, see L{kcoral.server.invariant}) before the worker says it
is ready.

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
from kcoral.errors import ProgramFailed, ProgramRejected
from kcoral.models.bundle import Bundle, BundleError, read_bundle
from kcoral.models.config import NO_CONFIG, ConfigError, ModelConfig, read_config
from kcoral.models.manifest import MANIFEST, NAME, ModelManifest, ProgramFile
from kcoral.models.versions import (
    VersionError,
    VersionPolicy,
    is_model,
    listed_versions,
    served_versions,
    stamp,
)
from kcoral.server.invariant import COUNT_DTYPE, row_by_row, row_size
from kcoral.server.programcheck import ProgramCheck
from kcoral.server.statetable import StateTable

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
    for each of its batch sizes (for size 0 when it is not batched); or,
    C{batch_invariant}, one for C{max_batch_size} rows that computes each
    row on its own and takes the count of real rows."""

    manifest: ModelManifest
    _params: tuple = attrs.field(repr=False)
    _executables: Mapping[int, Any] = attrs.field(repr=False)
    batch_invariant: bool = False
    #: What its load's configuration set (its manifest has its batch sizes).
    config: ModelConfig = NO_CONFIG
    #: A sequence model's live sequences' states (it runs by them alone).
    states: StateTable | None = attrs.field(default=None, repr=False)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs, by name in the manifest's order, of one request's
        C{inputs}; InvalidInput when they do not fit the model."""
        return self.run_batch(inputs, self.manifest.check(inputs))

    def run_batch(self, inputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """
        The outputs of C{rows} rows, their inputs already checked with
        C{manifest.check} (a batcher's requests concatenated): padded with
        zero rows up to the smallest compiled batch size that holds them (or,
        batch invariant, to C{max_batch_size}), the padding's outputs
        dropped. A row's outputs do not depend on the other rows of its batch
        beyond the model's rounding, as long as the model is row-wise; batch
        invariant, not at all.
        """
        arrays = [array for spec in self.manifest.inputs for array in spec.to_program(inputs[spec.name])]
        if not self.manifest.max_batch_size:
            # Not batched: one program, of the manifest's shapes, known as size 0.
            return self._outputs(self._executables[0](*self._params, *arrays), None)
        if self.batch_invariant:
            size, count = self.manifest.max_batch_size, [COUNT_DTYPE(rows)]
        else:
            size, count = self.manifest.batch_size_for(rows), []
        arrays = [_padded(array, size) for array in arrays]
        return self._outputs(self._executables[size](*self._params, *arrays, *count), rows)

    def _outputs(self, returned, rows: int | None) -> dict[str, np.ndarray]:
        """The outputs, by name, of the arrays its program C{returned}
        (their first C{rows} rows; None: all), a BYTES one's two arrays
        made one tensor again."""
        arrays = iter(returned)
        outputs = {}
        for spec in self.manifest.outputs:
            own = [np.asarray(next(arrays)) for _ in spec.program_tensors]
            if rows is not None:
                own = [array[:rows] for array in own]
            try:
                outputs[spec.name] = spec.from_program(own)
            except ValueError as e:
                raise ProgramFailed(f"output {spec.name!r}: {e}") from None
        return outputs


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    if len(array) == size:
        return array
    padded = np.zeros((size, *array.shape[1:]), array.dtype)
    padded[:len(array)] = array
    return padded


class ModelRepository:
    """
    The models in the folder C{path}: each folder directly in it that holds a
    C{model.json}, or numbered version folders of them, is one, named after
    its folder (L{kcoral.models.versions}). A model that cannot load is
    listed UNAVAILABLE with its reason; the others are served.

    C{observe_compile} is given the seconds of each compile; C{check} reads
    each program before it is compiled (L{kcoral.server.programcheck}). With
    C{batch_invariant}, a batched model's row has the same outputs, byte for
    byte, whatever else is in its batch (L{kcoral.server.invariant}).
    """

    def __init__(self, path: str | os.PathLike, *,
                 observe_compile: Callable[[float], None] = lambda seconds: None,
                 batch_invariant: bool = False, check: ProgramCheck | None = None):
        self.path = os.fspath(path)
        self._observe_compile = observe_compile
        self._check = check or ProgramCheck()
        self._batch_invariant = batch_invariant
        #: Each model's versions, by name and version.
        self._models: dict[str, dict[int, LoadedModel | ModelStatus]] = {}

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
                for version in listed_versions(os.path.join(self.path, name)):
                    self._settle(name, version, ModelStatus(name, version, UNAVAILABLE, NOT_LOADED))

    def load_model(self, name: str, device, config: ModelConfig = NO_CONFIG,
                   folder: str | None = None) -> list[ModelStatus]:
        """
        Load the versions of model C{name} that its policy serves (again)
        from its folder (or C{folder}, the files its load request sent)
        onto C{device}, configured by C{config} (what a load request gave)
        over what its folder's config.json sets; their states after. Each version is loaded beside the
        one served, which serves until the new one is ready (and goes on
        serving if it fails); versions the policy no longer serves are
        dropped once the others are all loaded, so that traffic moves to a
        new version only when it is ready, and a load that fails leaves what
        was served.
        """
        platform = "cuda" if device.platform == "gpu" else device.platform
        try:
            # A load's configuration sets what it sets; the folder's
            # config.json, the rest.
            source = folder or os.path.join(self.path, name)
            config = read_config(source).overridden(config)
            wanted = served_versions(source, config.policy or VersionPolicy())
        except (VersionError, ConfigError) as e:
            failed = ModelStatus(name, 1, UNAVAILABLE, str(e)[:MAX_REASON])
            log.warn("model {name} is unavailable: {reason}", name=name, reason=failed.reason)
            if not any(isinstance(m, LoadedModel) for m in self._models.get(name, {}).values()):
                self._models = {**self._models, name: {1: failed}}
            return [failed]
        states = [self._load_version(name, version, bundle, folder or self.path, device,
                                     platform, config)
                  for version, bundle in sorted(wanted.items(), key=lambda item: item[0] or 0)]
        if all(s.state == READY for s in states):
            # Only a load that is whole retires the versions it replaces:
            # one that failed leaves them serving, as the model was.
            kept = {s.version for s in states}
            self._models = {**self._models, name: {
                v: m for v, m in self._models.get(name, {}).items() if v in kept}}
        return states

    def _load_version(self, name: str, version: int | None, folder: str, within: str, device,
                      platform: str, config: ModelConfig) -> ModelStatus:
        """Load one version (None: the one its manifest says) of C{name} from
        C{folder}, which must be in C{within} once links are resolved."""
        number = version or 1
        try:
            bundle = read_bundle(folder, within=within)
            if version is None:
                number = bundle.manifest.version
            else:
                # A numbered folder's bundle is that version, whatever its manifest says.
                bundle = attrs.evolve(bundle, manifest=attrs.evolve(bundle.manifest,
                                                                    version=version))
            served = self._models.get(name, {}).get(number)
            if not isinstance(served, LoadedModel):
                self._settle(name, number, ModelStatus(name, number, LOADING))
            loaded = self._load(name, bundle, device, platform, config)
        except Exception as e:
            # Out of device memory and compile errors alike: XLA raises
            # no class of its own for either.
            reason = (str(e) if isinstance(e, (BundleError, ConfigError, _Unavailable)) else (
                f"failed to load onto {platform}: {_first_line(e)}"))[:MAX_REASON]
            log.warn("model {name} version {version} is unavailable: {reason}", name=name,
                     version=number, reason=reason)
            failed = ModelStatus(name, number, UNAVAILABLE, reason)
            if not isinstance(self._models.get(name, {}).get(number), LoadedModel):
                self._settle(name, number, failed)
            return failed
        self._settle(name, number, loaded)
        if loaded.batch_invariant and loaded.manifest.max_batch_size:
            log.info("model {name} version {version} is ready, batch-invariant: every batch runs "
                     "through one executable of {rows} rows that computes each row on its own",
                     name=name, version=number, rows=loaded.manifest.max_batch_size)
        else:
            log.info("model {name} version {version} is ready", name=name, version=number)
        return ModelStatus(name, number, READY)

    def unload_model(self, name: str) -> list[ModelStatus]:
        """Stop serving every version of model C{name} (requests running
        finish); their states after."""
        current = self._models.get(name)
        if current is None:
            raise UnknownModel(name)
        unloaded: dict[int, LoadedModel | ModelStatus] = {
            v: ModelStatus(name, v, UNAVAILABLE, UNLOADED) for v in current}
        self._models = {**self._models, name: unloaded}
        log.info("model {name} is unloaded", name=name)
        return [m for m in unloaded.values() if isinstance(m, ModelStatus)]

    def forget(self, name: str) -> None:
        """Drop model C{name}, whose folder is gone, from the index."""
        self._models = {n: m for n, m in self._models.items() if n != name}
        log.info("model {name} left the repository", name=name)

    def stamps(self) -> dict[str, tuple]:
        """Each model folder's bundles and policy as last written: a model
        whose stamp changes was exported again, or its versions changed."""
        return {name: stamp(os.path.join(self.path, name)) for name in self._folders()}

    def _settle(self, name: str, version: int, model: LoadedModel | ModelStatus) -> None:
        # Loading runs in a thread while the reactor lists the models: a new
        # mapping each time, never one changing under an iteration.
        self._models = {**self._models, name: {**self._models.get(name, {}), version: model}}

    def _folders(self, warn: bool = True) -> list[str]:
        """The model folders served, in name order; C{warn}: log those left out."""
        try:
            with os.scandir(self.path) as entries:
                folders = sorted(entry.name for entry in entries
                                 if entry.is_dir() and is_model(entry.path))
        except OSError as e:
            raise RepositoryError(f"model repository {self.path}: {e.strerror}") from None
        named = []
        for name in folders:
            if NAME.match(name):
                named.append(name)
            elif warn:
                log.warn("model folder {name!r} is not served: a model's name is 1-64 of "
                         "[A-Za-z0-9_.-]", name=name)
        if len(named) > MAX_MODELS and warn:
            log.warn("the model repository holds {count} models: serving the first {most}",
                     count=len(named), most=MAX_MODELS)
        return named[:MAX_MODELS]

    def _load(self, name: str, bundle: Bundle, device, platform: str,
              config: ModelConfig) -> LoadedModel:
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
        programs = {}
        for program in manifest.programs:
            try:
                programs[program.file] = self._check.deserialize(bundle.programs[program.file],
                                                                 program.file)
            except ProgramRejected as e:
                raise _Unavailable(str(e)) from None
            _check_signature(program.file, programs[program.file], manifest.as_program(), params)
            returned = [(a.dtype, a.shape) for a in programs[program.file].out_avals]
            if manifest.decoupled and len({shape[0] for _, shape in returned}) > 1:
                raise _Unavailable(f"{program.file} returns {_signature(returned)}: a decoupled "
                                   "model's outputs have one row an answer, the same number in each")
        manifest = _configured(manifest, config, programs, len(params))
        sharding = SingleDeviceSharding(device)
        invariant = self._batch_invariant and manifest.max_batch_size > 0
        executables = {}
        placed = tuple(jax.device_put(bundle.params, device))
        if manifest.sequence is not None:
            return LoadedModel(manifest, placed, {}, batch_invariant=invariant, config=config,
                               states=self._table(manifest, programs, placed, bundle.initial,
                                                  device, invariant))
        for program in manifest.programs:
            exported = programs[program.file]
            if not invariant:
                for size in program.batch_sizes or (0,):
                    executables[size] = self._compiled(exported.call, sharding, params,
                                                       _inputs(manifest, size))
            elif manifest.batch_sizes[0] in program.batch_sizes:
                # The program of the smallest size computes each row.
                size = row_size(exported, len(params), manifest.batch_sizes[0])
                executables[manifest.max_batch_size] = self._compiled(
                    row_by_row(exported.call, len(params), size), sharding, params,
                    [*_inputs(manifest, manifest.max_batch_size),
                     jax.ShapeDtypeStruct((), COUNT_DTYPE)])
        return LoadedModel(manifest, placed, executables, batch_invariant=self._batch_invariant,
                           config=config)

    def _table(self, manifest: ModelManifest, programs: Mapping[str, Any], params: tuple,
               initial: list[np.ndarray], device, invariant: bool) -> StateTable:
        """The state table of a sequence model, its step compiled for each
        batch size (batch invariant: for C{max_batch_size}, a row at a time)."""
        calls = {size: programs[program.file].call
                 for program in manifest.programs for size in program.batch_sizes}
        if invariant:
            smallest = next(p for p in manifest.programs if manifest.batch_sizes[0] in p.batch_sizes)
            exported = programs[smallest.file]
            calls = {manifest.max_batch_size: row_by_row(
                exported.call, len(params), row_size(exported, len(params), manifest.batch_sizes[0]))}
        table = StateTable(manifest, calls, params, initial, device, counted=invariant)
        started = time.perf_counter()
        table.warm()
        self._observe_compile(time.perf_counter() - started)
        return table

    def _compiled(self, function: Callable, sharding, params: list, inputs: list):
        import jax

        started = time.perf_counter()
        executable = jax.jit(function, in_shardings=sharding).lower(*params, *inputs).compile()
        self._observe_compile(time.perf_counter() - started)
        return executable

    def index(self) -> list[ModelStatus]:
        """Every version of every model known and its state, in name and
        version order, without reading the disk (what the worker serves)."""
        return _statuses(self._models)

    def listing(self) -> list[ModelStatus]:
        """
        The repository index, read now: every model folder of the
        repository, each version with its state (one never loaded: the
        versions a load would serve, C{not loaded}), and the models served
        or loading whose folder is gone, in name and version order. It reads
        the disk: call it off the reactor.
        """
        known = self._models  # one mapping: a load replaces it, never changes it
        try:
            folders = self._folders(warn=False)
        except RepositoryError:
            folders = []  # gone: what is served is still listed
        unread = [ModelStatus(name, version, UNAVAILABLE, NOT_LOADED) for name in folders
                  if name not in known
                  for version in listed_versions(os.path.join(self.path, name))]
        kept = set(folders) | {name for name, versions in known.items() if any(
            isinstance(m, LoadedModel) or m.state == LOADING for m in versions.values())}
        listed = [status for status in _statuses(known) if status.name in kept]
        return sorted(listed + unread, key=lambda status: (status.name, status.version))

    def get(self, name: str, version: int | None = None) -> LoadedModel:
        """The model C{name} at C{version} (None: its highest ready one) ready
        to run; L{UnknownModel} or L{ModelUnavailable} when it is not."""
        versions = self._models.get(name)
        if not versions:
            raise UnknownModel(name)
        if version is not None:
            model = versions.get(version)
            if model is None:
                raise UnknownModel(name, version)
        else:
            ready = [m for _, m in sorted(versions.items()) if isinstance(m, LoadedModel)]
            if ready:
                return ready[-1]
            # None ready: the state to say is a loading one's, else the highest's.
            statuses = [m for _, m in sorted(versions.items()) if isinstance(m, ModelStatus)]
            model = next((m for m in statuses if m.state == LOADING), statuses[-1])
        if isinstance(model, ModelStatus):
            raise ModelUnavailable(name, model.reason, model.state)
        return model


def _statuses(models: Mapping[str, Mapping[int, LoadedModel | ModelStatus]]) -> list[ModelStatus]:
    """Every version of C{models} and its state, in name and version order."""
    return [ModelStatus(name, version, READY) if isinstance(model, LoadedModel) else model
            for name, versions in sorted(models.items())
            for version, model in sorted(versions.items())]


class _Unavailable(Exception):
    """A model that cannot be served; the message says why."""


def _configured(manifest: ModelManifest, config: ModelConfig, programs: Mapping[str, Any],
                params: int) -> ModelManifest:
    """
    C{manifest} with the batch sizes of C{config}'s C{max_batch_size}: those
    below it, and it. A program exported with a symbolic batch dimension
    (its first input's first dimension is not a number) runs at any size; a
    program exported for given sizes runs at those alone. ConfigError when
    they cannot serve it, or the configuration is not of this model.
    """
    most = config.max_batch_size
    if most is not None and most != manifest.max_batch_size:
        if not manifest.max_batch_size or not most:
            raise ConfigError(f"max_batch_size {most}: the model was exported "
                              + ("batched" if manifest.max_batch_size else "not batched")
                              + f" (max_batch_size {manifest.max_batch_size}): export it again")
        sizes = tuple(s for s in manifest.batch_sizes if s < most) + (most,)
        symbolic = [p for p in manifest.programs if not isinstance(
            programs[p.file].in_avals[params].shape[0], int)]
        served: tuple[ProgramFile, ...]
        if symbolic:
            served = (attrs.evolve(symbolic[0], batch_sizes=sizes),)
        elif set(sizes) <= set(manifest.batch_sizes):
            served = tuple(attrs.evolve(p, batch_sizes=tuple(s for s in p.batch_sizes if s in sizes))
                           for p in manifest.programs if set(p.batch_sizes) & set(sizes))
        else:
            raise ConfigError(f"max_batch_size {most}: the bundle's programs run at batch sizes "
                              f"{list(manifest.batch_sizes)} alone (exported without a symbolic "
                              f"batch dimension): export it for {most}")
        manifest = attrs.evolve(manifest, max_batch_size=most, batch_sizes=sizes, programs=served)
    config.check(manifest)
    if manifest.sequence is not None:
        idle = config.sequence_idle_microseconds
        manifest = attrs.evolve(manifest, sequence=attrs.evolve(
            manifest.sequence, batching=config.sequence_batching or manifest.sequence.batching,
            max_idle_seconds=manifest.sequence.max_idle_seconds if idle is None else idle / 1e6))
    return manifest


def _inputs(manifest: ModelManifest, size: int) -> list:
    """The model's inputs at batch size C{size} (0: its fixed shapes)."""
    import jax

    return [jax.ShapeDtypeStruct((size, *shape[1:]) if size else shape, dtype)
            for spec in manifest.inputs for dtype, shape in spec.program_tensors]


def _check_signature(file: str, exported, manifest: ModelManifest, params: list) -> None:
    """Check that the program on one device takes the params then the inputs
    that the manifest describes, and returns its outputs."""
    if exported.nr_devices != 1:
        raise _Unavailable(f"{file}: exported for {exported.nr_devices} devices; a model runs on one")
    takes = [(p.dtype, p.shape) for p in params] + [
        tensor for s in manifest.inputs for tensor in s.program_tensors]
    returns = [tensor for s in manifest.outputs for tensor in s.program_tensors]
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
