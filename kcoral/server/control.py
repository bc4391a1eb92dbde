"""
Model control, as Triton names it: which models of the repository a worker
serves, and how that changes while it runs.

C{none} (the default): every model is loaded at start, the repository read
once. C{explicit}: only the models of C{--load-model} (C{*}: all) at start;
clients load and unload models while the worker runs
(C{POST /v2/repository/models/{m}/load}, C{/unload}). C{poll}: every model
at start, and the repository read again every C{--repository-poll-seconds}:
a new model folder is loaded, a model exported again is loaded again, a
folder removed stops being served.

Loading reads and compiles in a thread of its own, one model at a time, so
the worker's run threads keep serving meanwhile; a model served already is
served until its new load is ready (L{ModelRepository.load_model}).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from kcoral.errors import BadRequest, LoadFailed, NotFound
from kcoral.models.config import NO_CONFIG, ConfigError, ModelConfig, parse_config
from kcoral.models.manifest import NAME
from kcoral.server.models import READY, ModelRepository, ModelStatus, UnknownModel
from kcoral.server.sentfiles import SentFilesError, sent_folder

log = Logger()

MODES = ("none", "poll", "explicit")
#: The C{--load-model} name that stands for every model.
EVERY_MODEL = "*"
#: How much less CPU priority loading gets than serving (a nice value).
LOADING_NICENESS = 10


def _in_background(f, *args):
    """C{f(*args)} at a lower CPU priority than the threads that serve: a
    version compiled beside the served one takes the CPU they leave, so
    that requests meanwhile do not wait on it (Linux gives each thread a
    priority of its own; elsewhere this changes nothing)."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        me = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, me, max(os.getpriority(os.PRIO_PROCESS, me),
                                                    LOADING_NICENESS))
        except OSError:
            pass  # not allowed here: load at the same priority
    return f(*args)


class ModelControl(service.Service):
    """
    The control of C{repository}'s models in C{mode}: C{load_models} at
    start in explicit mode, a poll every C{poll_seconds} in poll mode (on
    C{clock}); C{device()} is the device the models load onto, known once
    the worker has started it. The files a load sends are written in
    C{files_dir} (None: the temporary folder) while it loads.
    """

    def __init__(self, repository: ModelRepository, *, mode: str, load_models: tuple[str, ...],
                 poll_seconds: float, device: Callable[[], object], reactor,
                 files_dir: str | None = None):
        self.repository = repository
        self.mode = mode
        self._load_models = load_models
        self._device = device
        self._files_dir = files_dir
        self._reactor = reactor
        self._threads = ThreadPool(minthreads=0, maxthreads=1, name="kcoral-models")
        self._poll = LoopingCall(self.poll)
        self._poll.clock = reactor
        self._poll_seconds = poll_seconds
        #: The manifests' stamps at the last read (poll mode).
        self._stamps: dict[str, tuple[int, int]] = {}

    @property
    def at_start(self) -> frozenset[str] | None:
        """The models to load at start (None: all)."""
        if self.mode != "explicit" or EVERY_MODEL in self._load_models:
            return None
        return frozenset(self._load_models)

    def startService(self) -> None:
        super().startService()
        self._threads.start()

    def load_at_start(self, device) -> None:
        """
        Load the models of the start onto C{device} (in a thread: it blocks).
        In poll mode the repository's stamps are read first, so that a model
        that changes while the start loads is loaded again at the first poll.
        """
        if self.mode == "poll":
            self._stamps = self.repository.stamps()
        self.repository.load(device, self.at_start)

    def started(self) -> None:
        """The models of the start are loaded: polling (if asked for) begins."""
        if self.mode == "poll" and self.running:
            self._poll.start(self._poll_seconds, now=False)

    def stopService(self):
        if self._poll.running:
            self._poll.stop()
        self._threads.stop()
        return super().stopService()

    def index(self) -> Deferred[list[ModelStatus]]:
        """The repository index (L{ModelRepository.listing}), read now, in
        the reactor's threads rather than the loading one: an index asked
        for while a model compiles answers at once."""
        return deferToThreadPool(self._reactor, self._reactor.getThreadPool(),
                                 self.repository.listing)

    def _in_thread(self, f, *args) -> Deferred:
        return deferToThreadPool(self._reactor, self._threads, _in_background, f, *args)

    def _refusal(self, verb: str) -> str | None:
        """Why models are not C{verb}ed on request (None: they are)."""
        if self.mode == "explicit":
            return None
        return (f"models are not {verb}ed on request in model control mode {self.mode!r}: "
                "start with --model-control-mode explicit")

    @inlineCallbacks
    def load(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None):
        """Load the versions of model C{name} (again) from its folder, or from
        C{files} (a model folder's files by relative path) when given,
        configured by C{config} (Triton's ModelConfig as JSON) if given;
        their states, READY. L{LoadFailed} with the reasons when the mode
        refuses it, the configuration cannot be honoured, the repository has
        no such folder (and no files came), the files cannot be written or a
        version fails; the model served meanwhile is served still."""
        refusal = self._refusal("load")
        configured = NO_CONFIG
        if refusal is None and config is not None:
            try:
                configured = parse_config(config)
            except ConfigError as e:
                refusal = str(e)
        if refusal is None and files and not NAME.match(name):
            refusal = "a model's name is 1-64 of [A-Za-z0-9_.-]"
        if refusal is None and not files and name not in (
                yield self._in_thread(self.repository.stamps)):
            refusal = "no such model in the repository"
        if refusal is not None:
            raise LoadFailed(f"failed to load '{name[:64]}': {refusal}")
        try:
            states = yield self._in_thread(self._load_from, name, self._device(), configured, files)
        except SentFilesError as e:
            raise LoadFailed(f"failed to load '{name[:64]}': failed to poll from model "
                             f"repository: {e}") from None
        failed = [s for s in states if s.state != READY]
        if failed:
            raise LoadFailed(f"failed to load '{name[:64]}': " + "; ".join(
                f"version {s.version}: {s.reason}" for s in failed))
        return states

    def _load_from(self, name: str, device, config: ModelConfig,
                   files: Mapping[str, bytes] | None) -> list[ModelStatus]:
        """L{ModelRepository.load_model}, from C{files} written to a folder
        of their own when given (in the loading thread: it writes)."""
        if not files:
            return self.repository.load_model(name, device, config)
        with sent_folder(files, self._files_dir) as folder:
            return self.repository.load_model(name, device, config, folder)

    def unload(self, name: str) -> list[ModelStatus]:
        """Stop serving model C{name}; its state after."""
        refusal = self._refusal("unload")
        if refusal is not None:
            raise BadRequest(refusal)
        try:
            return self.repository.unload_model(name)
        except UnknownModel:
            raise NotFound(f"failed to unload {name!r}: no such model in the repository") from None

    @inlineCallbacks
    def poll(self):
        """Read the repository again: load what is new or exported again,
        drop what is gone."""
        try:
            stamps = yield self._in_thread(self.repository.stamps)
        except Exception as e:
            log.warn("the model repository could not be read: {why}", why=e)
            return
        gone, changed = changes(self._stamps, stamps)
        self._stamps = stamps
        for name in gone:
            self.repository.forget(name)
        for name in changed:
            log.info("model {name} is new or changed in the repository: loading it", name=name)
            yield self._in_thread(self.repository.load_model, name, self._device())


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> tuple[list[str], list[str]]:
    """The models gone between two reads of a repository's stamps, and those
    new or changed, each in name order."""
    return (sorted(set(before) - set(after)),
            sorted(name for name, stamp in after.items() if before.get(name) != stamp))
