"""Images as requests send them (data URIs, bare base64, URLs) decoded at the ingress
within the app's limits: what is refused is refused with a 400 that says why, and a URL
is fetched only when fetching is on, never from loopback, link-local or private hosts."""

import base64
import io

import pytest
from PIL import Image

from serve_app.vision.decode import ImageError, decode_images
from serve_app.vision.image_args import PIL_LIMIT, ImageArgs


def png(w=20, h=10, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, kind="png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def refused(sources, match, **args):
    with pytest.raises(ImageError, match=match) as e:
        decode_images(sources, ImageArgs(**args))
    assert e.value.status == 400 and e.value.code == "invalid_image"


def test_inline_images_decode_to_their_pixels():
    [a, b] = decode_images([data_uri(png()), base64.b64encode(png(5, 7, (1, 2, 3))).decode()], ImageArgs())
    assert a.size == (20, 10) and a.mode == "RGB" and a.getpixel((0, 0)) == (200, 30, 30)
    assert b.size == (5, 7) and b.getpixel((4, 6)) == (1, 2, 3)
    rgba = io.BytesIO()
    Image.new("RGBA", (3, 3), (9, 9, 9, 0)).save(rgba, format="PNG")
    assert decode_images([data_uri(rgba.getvalue())], ImageArgs())[0].mode == "RGB"


def test_limits_and_broken_data_are_refused_with_the_reason():
    refused([data_uri(png())] * 3, "3 images; at most 2", max_images=2)
    refused([data_uri(png(100, 100))], "100x100 pixels; at most 5000", max_pixels=5000)
    refused([data_uri(png())] * 2, "more than", max_bytes=len(png()) + 10)
    refused([data_uri(png()[:40])], "could not be decoded")  # truncated
    refused([data_uri(b"not an image at all")], "could not be decoded")
    refused(["data:image/png;base64,@@@"], "not valid base64")
    refused(["data:image/png,rawbytes"], "must be base64")
    with pytest.raises(ValueError):
        ImageArgs(max_pixels=PIL_LIMIT + 1)  # never above PIL's decompression-bomb bound


def test_urls_are_not_fetched_unless_fetching_is_on_and_never_local_ones():
    refused(["https://example.com/cat.png"], "does not fetch image URLs")
    refused(["file:///etc/passwd"], "not file", fetch_urls=True)
    refused(["/etc/passwd"], "not a local path", fetch_urls=True)
    for url in ["http://127.0.0.1:1/x.png", "http://localhost/x.png", "http://10.0.0.1/x.png",
                "http://169.254.169.254/latest/meta-data", "http://[::1]/x.png", "http://192.168.1.1/x.png"]:
        refused([url], "loopback, link-local or private", fetch_urls=True)


@pytest.fixture
def local_server():
    """A real HTTP server on loopback that answers every GET with a PNG, and the requests
    it saw as (path, Host header)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers["Host"]))
            body = png()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], seen
    server.shutdown()


def test_a_url_is_fetched_from_the_address_that_was_checked(local_server, monkeypatch):
    """DNS rebinding: the name answers a public address when it is checked and loopback
    after. The fetch connects to the address checked (unreachable here), never to the
    loopback server; and a pinned connection reaches its address with the URL's Host."""
    import socket
    import urllib.request

    from serve_app.vision.decode import NoRedirect, PinnedHTTP

    port, seen = local_server
    real, answers = socket.getaddrinfo, iter(["1.1.1.1"])

    def rebinding(host, *args, **kwargs):
        return real(next(answers, "127.0.0.1") if host == "images.rebind.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    refused([f"http://images.rebind.test:{port}/cat.png"], "could not be fetched", fetch_urls=True, fetch_timeout_s=1)
    assert seen == []
    opener = urllib.request.build_opener(PinnedHTTP("127.0.0.1"), urllib.request.ProxyHandler({}), NoRedirect)
    with opener.open(f"http://images.example.test:{port}/cat.png", timeout=5) as r:
        assert r.read() == png()
    assert seen == [("/cat.png", f"images.example.test:{port}")]
