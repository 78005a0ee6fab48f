"""Images over the OpenAI chat and Anthropic messages routes, through the `openai` and `anthropic` SDKs,
against an app serving a Qwen2.5-VL checkpoint (M-RoPE positions and image grids cross into the engine's
process): data URLs, fetched URLs and base64 blocks give the tokens the offline engine gives; the model card
says it takes images; every bad image is a 400 naming the part; a text-only model refuses images with a 400."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.frontend.input_processor import InputProcessor
from tests.serve_app.conftest import delete_app

PNG_SIZE_LIMIT = 6_000  # max_media_bytes of the app: the big image below is over it


def _png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


SMALL, OTHER, BIG = _png(1, 24, 30), _png(2, 30, 20), _png(3, 80, 80)


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(3)
        body = {"/small.png": SMALL, "/big.png": BIG, "/slow.png": SMALL}.get(self.path)
        if self.path == "/elsewhere.png":  # a redirect off the allowed host
            self.send_response(302)
            self.send_header("Location", "http://localhost.invalid/small.png")
            self.end_headers()
            return
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def vlm_app(deploy_app, qwen2_5_vl_checkpoint) -> Iterator[str]:
    yield deploy_app("vlm", "/vlm", model=str(qwen2_5_vl_checkpoint), num_replicas=1,
                     engine={"max_model_len": 512, "num_kv_blocks": 128, "num_threads": 1,
                             "limit_mm_per_prompt": {"image": 2}},
                     allowed_media_domains=["127.0.0.1"], media_fetch_timeout_s=1.0, max_media_bytes=PNG_SIZE_LIMIT)
    delete_app("vlm")  # its replica would otherwise share the 2 cores with every later test


@pytest.fixture(scope="module")
def client(vlm_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm_app + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, *urls: str, text: str = "What is in"):
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": content}],
                                          extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def expected(qwen2_5_vl_checkpoint) -> str:
    """The offline engine's answer to SMALL and OTHER after "What is in" (one engine for the module)."""
    config = EngineConfig(model=str(qwen2_5_vl_checkpoint), max_model_len=512, num_kv_blocks=128)
    processor = InputProcessor.from_config(config)
    ids = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in"}, {"type": "image"}, {"type": "image"}]}])
    images = [Image.open(io.BytesIO(p)) for p in (SMALL, OTHER)]
    llm = LLM(str(qwen2_5_vl_checkpoint), max_model_len=512, num_kv_blocks=128)
    try:
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return out.outputs[0].text


def test_data_and_fetched_urls_give_the_offline_tokens(client, image_server, expected):
    by_data = _chat(client, _data_url(SMALL), _data_url(OTHER))
    assert by_data.choices[0].message.content == expected
    assert by_data.usage.prompt_tokens > 8 + 6  # each image's placeholders (4 x 4 and 4 x 2 squares) are in it
    by_url = _chat(client, image_server + "/small.png", _data_url(OTHER))  # the same pixels: the same tokens
    assert by_url.choices[0].message.content == expected
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


def test_anthropic_base64_blocks_give_the_offline_tokens(vlm_app, client, expected):
    claude = anthropic.Anthropic(base_url=vlm_app, api_key="unused", max_retries=0, timeout=60)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(png).decode()}} for png in (SMALL, OTHER)]
    content = [{"type": "text", "text": "What is in"}, *blocks]
    reply = claude.messages.create(model=client.models.list().data[0].id, max_tokens=6,
                                   messages=[{"role": "user", "content": content}],
                                   extra_body={"temperature": 0, "ignore_eos": True})
    assert reply.content[0].text == expected


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@not-base64", "base64 does not decode"),
    (_data_url(b"GIF89a but not really an image"), "not an image"),
    (_data_url(BIG), "larger than max_media_bytes"),
    ("ftp://127.0.0.1/small.png", "data:, http(s): or"),
    ("file:///etc/passwd", "allowed_local_media_path"),
    ("http://localhost.invalid/small.png", "not allowed"),
])
def test_bad_images_are_400_naming_the_part(client, url, message):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, url)
    assert error.value.status_code == 400 and error.value.body["param"] == "messages.0.content.1"
    assert message in str(error.value)


def test_fetch_limits(client, image_server):
    for path, message in [("/slow.png", "longer than"), ("/big.png", "larger than max_media_bytes"),
                          ("/elsewhere.png", "not allowed"), ("/missing.png", "HTTP 404")]:
        with pytest.raises(openai.BadRequestError, match=message):
            _chat(client, image_server + path)
    with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
        _chat(client, _data_url(SMALL), _data_url(SMALL), _data_url(SMALL))


def test_a_text_only_model_refuses_images(serve_app_url):
    plain = openai.OpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="text-only model"):
        _chat(plain, _data_url(SMALL))
