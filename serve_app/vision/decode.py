"""An image part of a request (a data URI, base64, or an http(s) URL when fetching is on)
as decoded pixels, within the app's limits; anything else is the client's error (400)."""

import base64
import binascii
import functools
import http.client
import io
import ipaddress
import socket
import urllib.parse
import urllib.request
from typing import List

from PIL import Image

from ..api.errors import ProtocolError
from .image_args import ImageArgs


class ImageError(ProtocolError):
    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message, param, code="invalid_image")


def decode_images(sources: List[str], args: ImageArgs) -> List[Image.Image]:
    """The request's images, in order, decoded to RGB."""
    if len(sources) > args.max_images:
        raise ImageError(f"the request has {len(sources)} images; at most {args.max_images} are accepted")
    images, room = [], args.max_bytes
    for source in sources:
        data = image_bytes(source, args, room)
        room -= len(data)
        if room < 0:
            raise ImageError(f"the request's images are more than {args.max_bytes} bytes")
        images.append(decode_image(data, args))
    return images


def decode_image(data: bytes, args: ImageArgs) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only
            w, h = probe.size
            if w * h > args.max_pixels:
                raise ImageError(f"an image is {w}x{h} pixels; at most {args.max_pixels} are accepted")
            probe.load()
            return probe.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(f"an image is above {args.max_pixels} pixels") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for broken data
        raise ImageError(f"an image could not be decoded: {type(e).__name__}: {e}") from None


def image_bytes(source: str, args: ImageArgs, room: int) -> bytes:
    if source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError("an image data URI must be base64: data:image/png;base64,...")
        return b64decode(payload)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        if not args.fetch_urls:
            raise ImageError("this server does not fetch image URLs (images.fetch_urls is off): send the image "
                             "inline, as a data URI")
        return fetch(source, args, room)
    if scheme or source.startswith("/"):
        raise ImageError(f"image URLs must be http(s) or data URIs, not {scheme or 'a local path'}")
    return b64decode(source)  # bare base64 (Anthropic's and some clients' way)


def b64decode(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's base64 data is not valid base64") from None


def fetch(url: str, args: ImageArgs, room: int) -> bytes:
    """The URL's bytes, if its host resolves to public addresses only (each one checked
    before any request is made) and the answer fits `room` bytes. The connection goes to
    an address that was checked, never to a second answer of the name (DNS rebinding),
    and never through a proxy (which would resolve the name itself)."""
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise ImageError("an image URL has no host")
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(host, None)]
    except OSError:
        raise ImageError(f"an image URL's host {host!r} does not resolve") from None
    for a in addresses:
        ip = ipaddress.ip_address(a.split("%")[0])
        if not ip.is_global:
            raise ImageError(f"image URLs may not point at loopback, link-local or private addresses ({host})")
    pinned = (PinnedHTTP(addresses[0]), PinnedHTTPS(addresses[0]), urllib.request.ProxyHandler({}), NoRedirect)
    try:
        with urllib.request.build_opener(*pinned).open(url, timeout=args.fetch_timeout_s) as r:
            data = r.read(room + 1)
    except Exception as e:  # noqa: BLE001 - network errors of every kind
        raise ImageError(f"an image URL could not be fetched: {e}") from None
    if len(data) > room:
        raise ImageError(f"the request's images are more than {args.max_bytes} bytes")
    return data


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead to an address that was never checked: refused."""

    def redirect_request(self, *args, **kwargs):
        raise ImageError("an image URL redirected; give the final URL")


class _Pinned:
    """An http.client connection that opens its socket to `address`, not to its host's name."""

    def __init__(self, *args, address: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.address = address

    def _socket(self) -> socket.socket:
        return socket.create_connection((self.address, self.port), self.timeout, self.source_address)


class _PinnedConnection(_Pinned, http.client.HTTPConnection):
    def connect(self):
        self.sock = self._socket()


class _PinnedTLSConnection(_Pinned, http.client.HTTPSConnection):
    def connect(self):  # the certificate is checked against the URL's host name, as usual
        self.sock = self._context.wrap_socket(self._socket(), server_hostname=self.host)


class PinnedHTTP(urllib.request.HTTPHandler):
    """http:// to the checked address (the Host header still names the URL's host)."""

    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def http_open(self, req):
        return self.do_open(functools.partial(_PinnedConnection, address=self.address), req)


class PinnedHTTPS(urllib.request.HTTPSHandler):
    """https:// to the checked address, TLS verified for the URL's host name."""

    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def https_open(self, req):
        return self.do_open(functools.partial(_PinnedTLSConnection, address=self.address), req,
                            context=self._context)
