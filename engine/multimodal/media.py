"""Images from a chat's content parts: `data:` URLs (base64), http(s) URLs from allowed hosts, and `file://`
paths under an allowed root, decoded with PIL, each failure a ValueError naming the message part (a 400).

Fetching is off unless `allowed_media_domains` names the host (the ingress must not become a proxy into the
cluster's network); a fetch has a timeout, a byte limit and a few redirects, each checked against the list.
A decoded image above `MAX_PIXELS` is refused before its pixels are read (a decompression bomb)."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

MAX_PIXELS = 40_000_000  # about a 6,300 x 6,300 image; larger ones are refused unread
_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaSettings:
    """The app args that bound what an image URL may fetch (serve_app/app_args.py)."""

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    media_fetch_timeout_s: float = 5.0
    max_media_bytes: int = 20 * 2**20
    preprocess_workers: int = 4  # threads that fetch, decode and process images in the ingress


_IMAGE_PARTS = ("image_url", "image_pil")


def split_image_parts(messages: list[dict]) -> tuple[list[dict], list[tuple[object, str]]]:
    """The chat's messages with each image part ({"type": "image_url", "image_url": {"url": ...}}, or offline
    {"type": "image_pil", "image_pil": <PIL image>}) as {"type": "image"}, what vision-language chat templates
    write a placeholder for; and each image's source (its URL, or the PIL image) with where it was
    ("messages.i.content.j"), in order."""
    sources, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                sources.append((url.get("url") if isinstance(url, dict) else None, f"messages.{i}.content.{j}"))
            elif kind == "image_pil":
                sources.append((part.get("image_pil"), f"messages.{i}.content.{j}"))
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part)
                continue
            else:
                raise ValueError(f"messages.{i}.content.{j}: parts of type {kind!r} are not supported")
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, sources


def load_images(sources: list[tuple[object, str]], settings: MediaSettings) -> list:
    """The PIL images of split_image_parts' sources: URLs loaded, PIL images as they are."""
    from PIL import Image

    return [source if isinstance(source, Image.Image) else load_image(source, settings, where)
            for source, where in sources]


def load_image(url: str, settings: MediaSettings, where: str):
    """The PIL image an `image_url` part names; ValueError naming `where` (e.g. "messages.0.content.1")."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: image_url.url must be a non-empty string")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, where, settings.max_media_bytes)
    elif scheme in ("http", "https"):
        data = _fetch(url, settings, where)
    elif scheme == "file":
        data = _local_file(url, settings, where)
    else:
        raise ValueError(f"{where}: image URLs must be data:, http(s): or (where allowed) file: URLs, not {scheme!r}")
    return decode_image(data, where)


def decode_image(data: bytes, where: str):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise ValueError(f"{where}: the image has {width} x {height} pixels, more than {MAX_PIXELS:,}")
        image.load()
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"{where}: not an image this server can decode ({type(e).__name__}: {e})") from None
    return image


def _data_url(url: str, where: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise ValueError(f"{where}: a data URL must be data:<type>;base64,<data>")
    if len(payload) * 3 // 4 > max_bytes:
        raise ValueError(f"{where}: the image is larger than max_media_bytes={max_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's base64 does not decode") from None


def _fetch(url: str, settings: MediaSettings, where: str) -> bytes:
    import httpx

    for _ in range(_MAX_REDIRECTS + 1):
        host = (urlparse(url).hostname or "").lower()
        if not any(host == d or host.endswith("." + d) for d in settings.allowed_media_domains):
            raise ValueError(f"{where}: fetching images from {host!r} is not allowed; the server's "
                             "allowed_media_domains lists the hosts it may fetch from")
        try:
            with httpx.stream("GET", url, timeout=settings.media_fetch_timeout_s, follow_redirects=False) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(response.url.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise ValueError(f"{where}: fetching the image got HTTP {response.status_code}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > settings.max_media_bytes:
                        limit = settings.max_media_bytes
                        raise ValueError(f"{where}: the image is larger than max_media_bytes={limit}")
                return bytes(body)
        except httpx.TimeoutException:
            timeout = settings.media_fetch_timeout_s
            raise ValueError(f"{where}: fetching the image took longer than {timeout} s") from None
        except httpx.HTTPError as e:
            raise ValueError(f"{where}: fetching the image failed: {type(e).__name__}") from None
    raise ValueError(f"{where}: more than {_MAX_REDIRECTS} redirects")


def _local_file(url: str, settings: MediaSettings, where: str) -> bytes:
    if settings.allowed_local_media_path is None:
        raise ValueError(f"{where}: file: URLs are refused unless the server sets allowed_local_media_path")
    root = Path(settings.allowed_local_media_path).resolve()
    path = Path(urlparse(url).path).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise ValueError(f"{where}: {path} is not a file under allowed_local_media_path")
    if path.stat().st_size > settings.max_media_bytes:
        raise ValueError(f"{where}: the image is larger than max_media_bytes={settings.max_media_bytes}")
    return path.read_bytes()
