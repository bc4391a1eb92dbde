"""
The dashboard's page and its assets, from the package's C{static} folder,
each with its content type and a Content-Security-Policy under which the
browser loads nothing but these files and the JSON of the same origin: no
script, style, image or font from anywhere else, no inline script, no frame.
"""

from __future__ import annotations

from importlib import resources

from kcoral.errors import NotFound
from kcoral.web.responses import error_response, with_length

PAGE = "index.html"

_TYPES = {
    PAGE: b"text/html; charset=utf-8",
    "dashboard.css": b"text/css; charset=utf-8",
    "dashboard.js": b"text/javascript; charset=utf-8",
}

POLICY = (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
          b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# Read once, at import: a few kilobytes, and the reactor never waits on a disk.
_FILES = {name: (resources.files(__package__) / "static" / name).read_bytes() for name in _TYPES}


def serve(request, name: str = PAGE) -> bytes:
    """The file C{name} of the dashboard, or a JSON 404."""
    content = _FILES.get(name)
    if content is None:
        return error_response(request, NotFound(f"the dashboard has no file {name[:100]}"))
    request.setHeader(b"Content-Type", _TYPES[name])
    request.setHeader(b"Content-Security-Policy", POLICY)
    request.setHeader(b"X-Content-Type-Options", b"nosniff")
    request.setHeader(b"Referrer-Policy", b"no-referrer")
    # A new version's page, not a cached one of the last.
    request.setHeader(b"Cache-Control", b"no-cache")
    return with_length(request, content)
