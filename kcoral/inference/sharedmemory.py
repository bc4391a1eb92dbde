"""
System shared memory, Triton's extension: a client on the same host
registers a POSIX shared-memory object as a named region, then names the
region in an inference instead of sending an input's bytes, or receiving
an output's.

The process that accepts the request (a standalone server, a node's
gateway) opens the region; it reads an input's bytes out of it into an
ordinary binary tensor, and writes an output that names a region into it
from the answer, which then carries no data for it. So whatever serves the
inference behind it (a confined worker) never opens C{/dev/shm}.

A region is read and written with C{pread} and C{pwrite} on its file, never
mapped: a client that shrinks the object after registering it gets short
reads (refused), where a mapping would fault the server's process.

A region's file stays open while anything holds the region: its registry
until it is unregistered, and each inference in flight that names it. Its
descriptor is closed when the last of them lets go, never under a read or
write in a thread: a closed descriptor's number is the next one the process
opens, perhaps another client's region, which an inference still holding
the old number would then read from and write into.

A region is one of two kinds behind L{IRegion}: a system one here, a CUDA
one (L{kcoral.inference.cudasharedmemory}) in device memory. Both kinds
share one registry, one namespace of names per client token as in Triton,
and one way of naming them in an inference, read and written here.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import re
import stat
import weakref

import attrs
from tritonclient.grpc import service_pb2
from twisted.internet.defer import Deferred, succeed
from zope.interface import Attribute, Interface, implementer

from kcoral.common.offreactor import off_reactor
from kcoral.errors import BadRequest
from kcoral.inference.message import GrpcAnswer, IInferMessage, RestMessage
from kcoral.protocol.decoupled import DECOUPLED_ANSWERS
from kcoral.protocol.inference import (
    MAX_HEADER_BYTES,
    ON_REACTOR_BYTES,
    InferAnswer,
    rest_of_grpc_infer,
)

__all__ = ["SHM_DIR", "SYSTEM", "Caller", "IRegion", "Placement", "SharedMemory"]

#: Where Linux keeps POSIX shared-memory objects: C{shm_open("/x")} is
#: the file C{/dev/shm/x}.
SHM_DIR = "/dev/shm"
#: A POSIX shared-memory name: one leading slash, no other, at most
#: NAME_MAX bytes after it; text (JSON may carry a lone surrogate, which
#: names no file).
_KEY = re.compile(r"\A/[^/\x00\ud800-\udfff]{1,255}\Z")
#: The most regions one client token may hold registered at once.
MAX_REGIONS = 256
#: The most a front holds, all clients together: each keeps a descriptor
#: open, which the front leaves out of its client connections' share of
#: its descriptors (L{kcoral.web.fdlimit}), as it does its caches'.
MAX_OPEN_REGIONS = 1024
#: The parameters that name a region, in an input or an output.
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
#: The names of a region, as of a model.
MAX_NAME_CHARS = 256
#: Why registration is refused where the server was not told to serve it.
OFF = "system shared memory is off: start the server with --allow-client-shm to serve it"
#: Why a Router refuses it: the region is on its client's host, not its own.
ROUTER = ("a Router serves no shared memory: its clients' regions are on another host; "
          "register them with the server or node gateway on the client's host")
#: Why a client on another host is refused.
NOT_LOOPBACK = "shared memory is served only to clients on this host (loopback)"
#: The kind of a system shared-memory region.
SYSTEM = "system"
#: A size past what L{off_reactor} does on the reactor: a region whose
#: reads and writes wait on its device is always read and written in a thread.
IN_THREAD = ON_REACTOR_BYTES + 1


@attrs.frozen
class Caller:
    """Who asks: the client token it presented (None: none), and the
    address it connects from."""

    token: bytes | None
    host: str

    @property
    def local(self) -> bool:
        """Whether it connects over loopback."""
        try:
            return ipaddress.ip_address(self.host.removeprefix("::ffff:")).is_loopback
        except ValueError:
            return False


class IRegion(Interface):
    """A registered region of one kind, which lets go of what it holds
    (a descriptor, a device mapping) once no one holds it."""

    name = Attribute("Its name, as its client registered it.")
    byte_size = Attribute("How many bytes it holds.")
    kind = Attribute("Which kind it is: L{SYSTEM}, or a device's (its status's family).")
    on_device = Attribute("Whether its reads and writes wait on a device (then in a thread).")

    def status() -> dict:
        """Its status, in Triton's form for its kind."""

    def read_into(offset: int, view: memoryview) -> None:
        """Its bytes from C{offset}, as many as C{view} holds, into C{view}."""

    def write(offset: int, data: memoryview) -> None:
        """C{data} into it at C{offset}."""


@implementer(IRegion)
@attrs.frozen(eq=False)
class _Region:
    """A registered region: C{byte_size} bytes from C{offset} of the object
    C{key}, open as C{fd}, which is closed once no one holds the region."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    kind = SYSTEM
    on_device = False

    def __attrs_post_init__(self) -> None:
        weakref.finalize(self, os.close, self.fd)

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def read_into(self, offset: int, view: memoryview) -> None:
        start, done = self.offset + offset, 0
        while done < len(view):
            count = os.preadv(self.fd, [view[done:]], start + done)
            if count == 0:
                raise BadRequest(f"shared memory region {self.name[:64]!r} is shorter "
                                 "than it was when registered")
            done += count

    def write(self, offset: int, data: memoryview) -> None:
        # The object may have shrunk since it was registered: a write past
        # its end would grow it again, which its owner did not ask for.
        if os.fstat(self.fd).st_size < self.offset + offset + len(data):
            raise BadRequest(f"shared memory region {self.name[:64]!r} is shorter than it "
                             "was when registered")
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], self.offset + offset + written)


@attrs.frozen
class _Slice:
    """Where an input or output lies: C{size} bytes from C{offset} of C{region}."""

    region: IRegion
    offset: int
    size: int

    def read_into(self, view: memoryview) -> None:
        """Its bytes into C{view}, of its size."""
        self.region.read_into(self.offset, view)

    def write(self, data: memoryview) -> None:
        """C{data}, at most its size, into its place."""
        self.region.write(self.offset, data)


@attrs.frozen
class Placement:
    """The outputs of one inference to write into regions, by name."""

    outputs: dict[str, _Slice]

    def place(self, answer: InferAnswer | GrpcAnswer) -> Deferred[InferAnswer]:
        """C{answer} with the outputs named here written into their
        regions and carrying no data (off the reactor when large)."""
        # The message was made in REST's form, and is answered in it.
        assert isinstance(answer, InferAnswer)
        if not self.outputs:
            return succeed(answer)
        on_device = any(where.region.on_device for where in self.outputs.values())
        return off_reactor(IN_THREAD if on_device else len(answer.body), self._placed, answer)

    def _placed(self, answer: InferAnswer) -> InferAnswer:
        view = memoryview(answer.body)
        size = len(view) if answer.header_length is None else answer.header_length
        header = json.loads(bytes(view[:size]))
        if (header.get("parameters") or {}).get(DECOUPLED_ANSWERS):
            # One slice cannot hold several answers' outputs: refused before
            # any is written over.
            raise BadRequest("a decoupled model's outputs are not written to shared memory: "
                             "ask for them in its answers")
        offset, kept = size, []
        for output in header.get("outputs", []):
            parameters = output.get("parameters") or {}
            length = parameters.get("binary_data_size")
            data = view[offset:offset + length] if length is not None else None
            if length is not None:
                offset += length
            where = self.outputs.get(output["name"])
            if where is None:
                if data is not None:
                    kept.append(data)
                continue
            if data is None or len(data) > where.size:
                raise BadRequest(f"output {output['name'][:64]!r} is {len(data or b'')} bytes, "
                                 f"its shared memory slice {where.size}")
            where.write(data)
            parameters.pop("binary_data_size", None)
            output.pop("data", None)
            parameters.update({REGION: where.region.name, BYTE_SIZE: where.size})
            if where.offset:
                parameters[OFFSET] = where.offset
            output["parameters"] = parameters
        encoded = json.dumps(header).encode()
        if not kept:
            return InferAnswer(encoded, None)
        return InferAnswer(b"".join([encoded, *kept]), len(encoded))


class SharedMemory:
    """
    The system shared-memory regions of one front, by client token (with
    C{namespaced} False, where the service has no tokens, one namespace).
    C{refused}: why registration is refused (None: it is served). A region
    is at most C{max_bytes}; its object is opened from C{directory}.
    """

    def __init__(self, *, refused: str | None, max_bytes: int, namespaced: bool = False,
                 directory: str = SHM_DIR):
        self.refused = refused
        self._max_bytes = max_bytes
        self._namespaced = namespaced
        self._directory = directory
        self._regions: dict[bytes, dict[str, IRegion]] = {}

    @property
    def descriptors(self) -> int:
        """How many descriptors its regions may hold open at most."""
        return 0 if self.refused is not None else MAX_OPEN_REGIONS

    def _space(self, caller: Caller) -> bytes:
        # A digest: the token itself is never kept.
        if not self._namespaced or caller.token is None:
            return b""
        return hashlib.sha256(caller.token).digest()

    def register(self, caller: Caller, name: str, key: object, offset: object,
                 byte_size: object) -> None:
        """Register region C{name}: C{byte_size} bytes from C{offset} of
        the shared-memory object C{key}; L{BadRequest} says why not."""
        if self.refused is not None:
            raise BadRequest(self.refused)
        if not caller.local:
            raise BadRequest(NOT_LOOPBACK)
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise BadRequest(f"a region's name must be 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(key, str) or not _KEY.match(key):
            raise BadRequest(f"Unable to open shared memory region: {str(key)[:64]!r}: a key is a "
                             "POSIX shared memory name, '/' then up to 255 bytes of text with no '/'")
        if type(offset) is not int or type(byte_size) is not int or offset < 0 or byte_size < 1:
            raise BadRequest(f"failed to register shared memory region {name[:64]!r}: offset and "
                             "byte_size must be counts of bytes, byte_size at least 1")
        if byte_size > self._max_bytes:
            raise BadRequest(f"failed to register shared memory region {name[:64]!r}: byte_size "
                             f"{byte_size} is over the {self._max_bytes} bytes a request may hold")
        self.room(caller, name)
        fd = self._open(key)
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            os.close(fd)
            raise BadRequest(f"failed to register shared memory region {name[:64]!r}: offset "
                             f"{offset} and byte_size {byte_size} run past the object's "
                             f"{size} bytes")
        self.add(caller, _Region(name, key, offset, byte_size, fd))

    def room(self, caller: Caller, name: str) -> None:
        """L{BadRequest} unless C{caller} may register a region C{name}, of any kind."""
        regions = self._regions.get(self._space(caller), {})
        if name in regions:
            raise BadRequest(f"shared memory region {name[:64]!r} already in manager")
        if len(regions) >= MAX_REGIONS:
            raise BadRequest(f"failed to register shared memory region {name[:64]!r}: "
                             f"{MAX_REGIONS} regions are already registered")
        if sum(map(len, self._regions.values())) >= MAX_OPEN_REGIONS:
            raise BadRequest(f"failed to register shared memory region {name[:64]!r}: "
                             f"{MAX_OPEN_REGIONS} regions of all clients are registered")

    def add(self, caller: Caller, region: IRegion) -> None:
        """Register C{region} of any kind for C{caller}, if there is L{room}
        for it still (its opening may have run in a thread)."""
        self.room(caller, region.name)
        self._regions.setdefault(self._space(caller), {})[region.name] = region

    def _open(self, key: str) -> int:
        """The object C{key}, open to read and write: a regular file of
        the shared-memory folder, never a link out of it."""
        try:
            fd = os.open(os.path.join(self._directory, key[1:]),
                         os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise BadRequest(f"Unable to open shared memory region: {key[:64]!r}: "
                             f"{os.strerror(e.errno or 0)}") from None
        status = os.fstat(fd)
        why = ("not a shared memory object" if not stat.S_ISREG(status.st_mode)
               else None if _granted(status) else os.strerror(errno.EACCES))
        if why is not None:
            os.close(fd)
            raise BadRequest(f"Unable to open shared memory region: {key[:64]!r}: {why}")
        return fd

    def unregister(self, caller: Caller, name: str | None) -> None:
        """Unregister system region C{name} of C{caller}'s (None: all of them)."""
        if not self.remove(caller, name, SYSTEM) and name is not None:
            raise BadRequest(f"Unable to find system shared memory region: {name[:64]!r}")

    def remove(self, caller: Caller, name: str | None, kind: str) -> bool:
        """Unregister C{caller}'s region C{name} of C{kind} (None: all of
        that kind); whether there was one. An inference in flight that
        names it keeps it until it is done."""
        regions = self._regions.get(self._space(caller), {})
        found = [n for n, r in regions.items() if r.kind == kind and name in (None, n)]
        for n in found:
            del regions[n]
        return bool(found)

    def status(self, caller: Caller, name: str | None) -> list[dict]:
        """The status of system region C{name} of C{caller}'s (None: all of them)."""
        if name is None:
            return [region.status() for region in self.regions(caller, SYSTEM)]
        region = self._region(self._regions.get(self._space(caller), {}), name)
        if region.kind != SYSTEM:
            raise BadRequest(f"Unable to find system shared memory region: {name[:64]!r}")
        return [region.status()]

    def regions(self, caller: Caller, kind: str) -> list[IRegion]:
        """C{caller}'s regions of C{kind}."""
        return [r for r in self._regions.get(self._space(caller), {}).values() if r.kind == kind]

    @staticmethod
    def _region(regions: dict[str, IRegion], name: object) -> IRegion:
        region = regions.get(name) if isinstance(name, str) else None
        if region is None:
            raise BadRequest(f"Unable to find shared memory region: {str(name)[:64]!r}")
        return region

    def _slice(self, caller: Caller, what: str, parameters: dict) -> _Slice:
        """Where the input or output C{what} with C{parameters} lies."""
        region = self._region(self._regions.get(self._space(caller), {}), parameters.get(REGION))
        size, offset = parameters.get(BYTE_SIZE), parameters.get(OFFSET, 0)
        if type(size) is not int or type(offset) is not int or size < 0 or offset < 0 \
                or offset + size > region.byte_size:
            raise BadRequest(f"{what}: Invalid offset + byte size for shared memory region: "
                             f"{region.name[:64]!r}")
        return _Slice(region, offset, size)

    # -- inferences -------------------------------------------------------------------------

    def resolve(self, caller: Caller, message: IInferMessage
                ) -> Deferred[tuple[IInferMessage, Placement]] | None:
        """
        C{message} with every input that names a region read out of it into
        a binary tensor, and the outputs to write into regions; None when
        it names none (it is served as it is).
        """
        if isinstance(message, RestMessage):
            size = len(message.body) if message.header_length is None else message.header_length
            if size > MAX_HEADER_BYTES or REGION.encode() not in bytes(message.body[:size]):
                return None  # a header too large is refused where it is read
            try:
                header = json.loads(bytes(message.body[:size]))
            except (ValueError, RecursionError):
                return None  # refused as the request it is, where it is read
            if not isinstance(header, dict) or not isinstance(header.get("inputs", []), list) \
                    or not isinstance(header.get("outputs") or [], list):
                return None
            return off_reactor(self._in_thread(caller) or self._bound(header), self._rest, caller,
                               message, header, size)
        pb = getattr(message, "message", None)
        if not isinstance(pb, service_pb2.ModelInferRequest) or not any(
                REGION in t.parameters for t in (*pb.inputs, *pb.outputs)):
            return None
        return off_reactor(self._in_thread(caller) or self._bound_of(pb), self._grpc, caller, pb)

    def _in_thread(self, caller: Caller) -> int:
        """L{IN_THREAD} where C{caller} holds a region on a device (whose
        copies wait for the device's work), else 0."""
        regions = self._regions.get(self._space(caller), {}).values()
        return IN_THREAD if any(r.on_device for r in regions) else 0

    def _bound(self, header: dict) -> int:
        """How many bytes a request's regions may give it, at most: for
        choosing where it is read."""
        return sum(int(e.get("parameters", {}).get(BYTE_SIZE) or 0)
                   for e in header.get("inputs", []) if isinstance(e, dict)
                   and isinstance(e.get("parameters"), dict)
                   and type(e["parameters"].get(BYTE_SIZE)) is int)

    @staticmethod
    def _bound_of(pb: service_pb2.ModelInferRequest) -> int:
        return sum(t.parameters[BYTE_SIZE].int64_param for t in pb.inputs if BYTE_SIZE in t.parameters)

    def _rest(self, caller: Caller, message: RestMessage, header: dict, size: int
              ) -> tuple[IInferMessage, Placement]:
        view = memoryview(message.body)
        offset, parts = size, list[memoryview | _Slice]()
        for entry in header.get("inputs", []):
            parameters = entry.get("parameters") if isinstance(entry, dict) else None
            if not isinstance(parameters, dict):
                continue
            length = parameters.get("binary_data_size")
            if REGION in parameters:
                where = self._slice(caller, f"input {str(entry.get('name'))[:64]!r}", parameters)
                entry["parameters"] = {"binary_data_size": where.size}
                parts.append(where)
            elif type(length) is int and length >= 0:
                parts.append(view[offset:offset + length])
                offset += length
        # A few bytes of request may name one large region many times: what
        # they add up to is bounded as a request's body is, before any of
        # it is allocated.
        data = sum(len(p) if isinstance(p, memoryview) else p.size for p in parts)
        if data > self._max_bytes:
            raise BadRequest(f"the inputs are {data} bytes with those in shared memory, over the "
                             f"{self._max_bytes} bytes a request may hold")
        placed = self._outputs(caller, header)
        encoded = json.dumps(header).encode()
        # One buffer, each region's bytes read straight into their place.
        body = bytearray(len(encoded) + data)
        body[:len(encoded)] = encoded
        at = len(encoded)
        for part in parts:
            if isinstance(part, memoryview):
                body[at:at + len(part)] = part
                at += len(part)
            else:
                part.read_into(memoryview(body)[at:at + part.size])
                at += part.size
        return RestMessage(memoryview(body), len(encoded)), placed

    def _outputs(self, caller: Caller, header: dict) -> Placement:
        """The outputs of a REST request's C{header} that name a region,
        asked for in binary instead."""
        outputs = {}
        for entry in header.get("outputs") or []:
            parameters = entry.get("parameters") if isinstance(entry, dict) else None
            if isinstance(parameters, dict) and REGION in parameters:
                outputs[str(entry.get("name"))] = self._slice(
                    caller, f"output {str(entry.get('name'))[:64]!r}", parameters)
                entry["parameters"] = {"binary_data": True}
        return Placement(outputs)

    def _grpc(self, caller: Caller, pb: service_pb2.ModelInferRequest
              ) -> tuple[IInferMessage, Placement]:
        """As L{_rest}, from a gRPC message: its REST form, with each input
        that names a region empty there, then read into its place."""
        copy = service_pb2.ModelInferRequest(model_name=pb.model_name, id=pb.id,
                                              inputs=pb.inputs, outputs=pb.outputs)
        # Triton's clients send raw_input_contents for the inputs that
        # name no region, in order.
        raw = iter(pb.raw_input_contents)
        regions = {}
        for i, tensor in enumerate(copy.inputs):
            if REGION in tensor.parameters:
                regions[i] = {key: _value(value) for key, value in tensor.parameters.items()}
                tensor.ClearField("contents")
            if pb.raw_input_contents:
                copy.raw_input_contents.append(b"" if i in regions else next(raw, b""))
        rest = rest_of_grpc_infer(copy)
        header = json.loads(bytes(rest.body[:rest.header_length]))
        for i, parameters in regions.items():
            header["inputs"][i]["parameters"] = parameters
        for entry, output in zip(header.get("outputs", []), copy.outputs):
            if REGION in output.parameters:
                entry["parameters"] = {key: _value(value) for key, value in output.parameters.items()}
        return self._rest(caller, RestMessage(rest.body, rest.header_length), header,
                          rest.header_length or 0)

    def close(self) -> None:
        """Unregister every region of every client."""
        self._regions.clear()


def _granted(status: os.stat_result) -> bool:
    """
    Whether an object's mode lets this process's user read and write it as
    any process of that user, without privilege. A node's gateway is not
    confined, and as root it would open every user's objects: a client with
    the token would reach the shared memory of programs of users it is not.
    """
    if status.st_uid == os.geteuid():
        return status.st_mode & 0o600 == 0o600
    if status.st_gid == os.getegid() or status.st_gid in os.getgroups():
        return status.st_mode & 0o060 == 0o060
    return status.st_mode & 0o006 == 0o006


def _value(parameter: service_pb2.InferParameter) -> object:
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)

