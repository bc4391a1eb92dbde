"""
A request's one canonical path, made from its request line before anything
reads it: the guard, the front's family lookup, Klein, the Router's proxy
and the metrics all read this one value, so that no spelling of a path can
be routed one way and guarded another.

The rules (doc/security.rst lists them for operators):

 - a percent-escape of an unreserved character (C{A-Z a-z 0-9 - . _ ~}) is
   decoded, once (C{/v1/ru%6E} is C{/v1/run}); the hex digits may be in
   either case;
 - an escape of any other character (C{%2F}, C{%3B}, C{%25}, C{%00}, ...)
   is refused: no KCoral route has a segment that holds one, and decoding
   it would change where the request goes;
 - an empty segment (C{//}, and a trailing slash: C{/v1/run/}) or a dot
   segment (C{.}, C{..}, escaped or not) is refused: a client and a proxy
   in front may resolve them differently;
 - C{;params}, and any byte that is not a path character of RFC 3986
   (control characters, spaces, C{"<>\\^`{|}}, non-ASCII) are refused;
 - paths are case-sensitive: C{/V1/run} is another path (no route: 404).

The query, after the first C{?}, is kept as sent (only C{DELETE
/v1/nodes/{id}} reads one). C{*} (C{OPTIONS *}) is a target of its own.
"""

from __future__ import annotations

import re

from kcoral.errors import BadRequest

#: RFC 3986's unreserved characters: escaping one of them changes nothing.
_UNRESERVED = b"A-Za-z0-9\\-._~"
#: A canonical path: segments of unreserved characters and sub-delimiters
#: (but C{;}), C{:} and C{@}, none of them C{.} or C{..}; or the root alone.
#: One expression: it is matched on every request.
_CANONICAL = re.compile(rb"/|(?:/(?!\.\.?(?:/|\Z))[" + _UNRESERVED + rb"!$&'()*+,=:@]+)+")
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_UNRESERVED_BYTE = re.compile(rb"[" + _UNRESERVED + rb"]")
_DOT_SEGMENT = re.compile(rb"/\.\.?(?:/|\Z)")


def _unescaped(match: re.Match[bytes]) -> bytes:
    char = bytes((int(match.group(1), 16),))
    if _UNRESERVED_BYTE.fullmatch(char):
        return char
    raise BadRequest(f"the path holds an escaped {char.decode('latin-1')!r}, which no route takes: "
                     f"send the path unescaped")


def decoded(path: bytes) -> bytes:
    """C{path} with its escapes of unreserved characters decoded; a
    L{BadRequest} for any other escape, or a C{%} that starts none."""
    path = _ESCAPE.sub(_unescaped, path)
    if b"%" in path:
        raise BadRequest("the path holds a % that starts no escape")
    return path


def canonical(target: bytes) -> tuple[bytes, bytes]:
    """
    The canonical path of a request line's target, and its canonical form
    (that path, then its query as sent): a L{BadRequest} saying why when the
    path breaks a rule above.
    """
    if target == b"*":
        return target, target
    path, question, query = target.partition(b"?")
    if b"%" in path:
        path = decoded(path)
    if _CANONICAL.fullmatch(path) is None:
        raise BadRequest(_why(path))
    return path, path + question + query


def _why(path: bytes) -> str:
    """Why C{path}, decoded but not canonical, is refused."""
    if not path.startswith(b"/"):
        return "the request target must be a path (starting with /)"
    if b";" in path:
        return "the path holds ;parameters, which no route takes"
    if _DOT_SEGMENT.search(path):
        return "the path holds a dot segment (. or ..)"
    if b"//" in path or path.endswith(b"/"):
        return "the path holds an empty segment (// or a trailing /)"
    return "the path holds a character that is not allowed in a path"


def form_of(target: bytes) -> bytes:
    """The path of a refused C{target}, as near to canonical as it goes: what
    chooses its error's form (a family's own, or KCoral's)."""
    path = target.partition(b"?")[0]
    try:
        return decoded(path)
    except BadRequest:
        return path
