"""The `images:` keys of the app's args."""

from PIL import Image
from pydantic import Field

from mlx_worker.strict_model import StrictModel

PIL_LIMIT = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb bound (89.5 MP)


class ImageArgs(StrictModel):
    max_images: int = Field(50, ge=0)
    """Images in one request at most."""
    max_pixels: int = Field(PIL_LIMIT, ge=1, le=PIL_LIMIT)
    """Pixels of one image at most (width x height, decoded); at most PIL's decompression-bomb bound."""
    max_bytes: int = Field(50_000_000, ge=1)
    """Encoded image bytes in one request at most (inline and fetched)."""
    fetch_urls: bool = False
    """Fetch http(s) image URLs; off: only inline images (data URIs, base64). Never loopback, link-local or private addresses; never file://."""
    fetch_timeout_s: float = Field(10.0, gt=0)
    """One URL's fetch, connecting and reading, at most."""
