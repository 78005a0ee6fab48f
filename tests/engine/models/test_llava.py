"""LLaVA (engine/models/llava.py) offline: images in prompts through the checkpoint's own processor, greedy tokens
and logprobs equal to Hugging Face's `generate` on the same random weights (one image, two of different sizes,
the same image twice, text only) in the default, no-prefix-cache and chunked modes (a chunk boundary inside
an image's tokens); the prefix cache keys blocks by the images in them; the encoder runs once per image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from tests.parity import assert_output_matches

TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


RED, WIDE, TALL = _image(1, 40, 40), _image(2, 30, 70), _image(3, 90, 36)


@pytest.fixture(scope="module")
def llava(llava_checkpoint) -> Path:
    return llava_checkpoint


def _hf(path: Path, prompt: str, images: list) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Hugging Face's prompt ids, greedy tokens and each step's log_softmax."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = AutoProcessor.from_pretrained(path)(text=prompt, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out.sequences[0, len(prompt_ids):].tolist(), [x[0].float().log_softmax(-1) for x in out.logits]


CASES = {
    "one image": ("Describe <image> in a few words.", [RED]),
    "two sizes": ("Compare <image> with <image>, please.", [WIDE, TALL]),
    "same image twice": ("<image><image> the same?", [RED, RED]),  # side by side
    "text only": ("No image here, only words.", []),
}


@pytest.fixture(scope="module")
def references(llava) -> dict[str, tuple]:
    return {name: _hf(llava, prompt, images) for name, (prompt, images) in CASES.items()}


@pytest.mark.parametrize("mode", [{}, {"enable_prefix_caching": False},
                                  {"max_num_batched_tokens": 8, "block_size": 4}])  # chunks cut through images
def test_greedy_tokens_and_logprobs_equal_hugging_face(llava, references, mode):
    llm = LLM(str(llava), **({"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256} | mode))
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in CASES.values()]
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False)  # twice: the second round from the prefix cache
    for name, out in zip(list(CASES) * 2, outputs):
        assert_output_matches(out, references[name], what=name)


def test_siglip_tower_equals_hugging_face(tmp_path):
    """LLaVA over SigLIP (llava-interleave's tower): no class position or pre-norm, the last layer's states
    before the pooling head, every position kept."""
    from tests.conftest import write_llava_checkpoint

    path = write_llava_checkpoint(tmp_path, tower="siglip")
    cases = {name: CASES[name] for name in ("two sizes", "text only")}
    llm = LLM(str(path), dtype="float32", max_model_len=512, num_kv_blocks=256)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases.values()], GREEDY,
                           use_tqdm=False)
    for (prompt, images), out in zip(cases.values(), outputs):
        assert_output_matches(out, _hf(path, prompt, images), what=prompt)


def test_prefix_cache_keys_blocks_by_their_images(llava):
    llm = LLM(str(llava), dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=4)
    prompt = "Look: <image> and tell me what it shows."
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(image) -> int:
        out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
        return out.num_cached_tokens

    assert cached(RED) == 0
    first_image_token = llm.llm_engine.prepare_request(prompt, multi_modal_data={"image": RED}).mm_inputs[0].offset
    assert cached(RED) > first_image_token + 16  # the image's blocks and the text after them
    assert cached(WIDE) <= first_image_token  # same tokens, another image: only the text before it


def test_the_encoder_runs_once_for_an_image_requests_share(llava):
    """...and its stats and step timings say so: what the Prometheus counters and the vision_encoder spans
    (serve_app) are made from."""
    llm = LLM(str(llava), dtype="float32", max_model_len=512, num_kv_blocks=256, enable_prefix_caching=False,
              collect_step_timings=True)
    prompts = [{"prompt": f"Request {i}: <image> shows", "multi_modal_data": {"image": RED}} for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    cache = llm.llm_engine.core.batch_builder.encoder_cache
    assert cache.num_encoded == 1 and cache.num_hits == 0  # one step prefilled all four: one encode, one read
    steps = outputs[0].metrics.steps
    assert steps[0].encoder_seconds > 0 and all(s.encoder_seconds == 0 for s in steps[1:])  # then decodes
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert cache.num_encoded == 1 and cache.num_hits == 1
    stats = llm.llm_engine.core.get_stats()
    assert (stats.mm_prompt_images, stats.mm_images_encoded, stats.mm_encoder_cache_hits) == (5, 1, 1)
    assert stats.mm_encoder_seconds >= steps[0].encoder_seconds


def test_bad_images_are_refused_naming_the_field(llava, tiny_model_path):
    llm = LLM(str(llava), dtype="float32", max_model_len=512, num_kv_blocks=64, limit_mm_per_prompt={"image": 1})
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="multi_modal_data: 2 images exceed limit_mm_per_prompt"):
        engine.prepare_request("<image> <image>", multi_modal_data={"image": [RED, RED]})
    with pytest.raises(ValueError, match="multi_modal_data: 1 images for 0 image placeholder tokens"):
        engine.prepare_request("no placeholder", multi_modal_data={"image": RED})
    with pytest.raises(ValueError, match="multi_modal_data: image 0 is a str"):
        engine.prepare_request("<image>", multi_modal_data={"image": "not an image"})
    with pytest.raises(ValueError, match="multi_modal_data: video not supported"):
        engine.prepare_request("<image>", multi_modal_data={"video": []})
    text_only = LLM(str(tiny_model_path), max_model_len=256, num_kv_blocks=32)
    with pytest.raises(ValueError, match="multi_modal_data: .* is a text-only model"):
        text_only.generate([{"prompt": "Hi", "multi_modal_data": {"image": RED}}], use_tqdm=False)


def test_tensor_parallel_and_refusals(llava):
    """The tower is whole on each rank, the language model split: TP=2 gives one rank's tokens. What is not
    built for images yet is refused by name."""
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in CASES.values()]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)
    one = LLM(str(llava), **engine).generate(prompts, params, use_tqdm=False)
    two = LLM(str(llava), **engine, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in one]
    two.shutdown()
    for kwargs, field in [({"enable_lora": True}, "enable_lora"), ({"quantization": "int8"}, "quantization"),
                          ({"kv_transfer_config": {"kv_connector": "shared_memory", "kv_role": "kv_both"}},
                           "kv_transfer_config")]:
        with pytest.raises(ValueError, match=f"{field}: .*LlavaForConditionalGeneration"):
            LLM(str(llava), max_model_len=256, num_kv_blocks=64, **kwargs)


def test_chat_takes_image_parts(llava):
    import base64
    import io

    llm = LLM(str(llava), dtype="float32", max_model_len=256, num_kv_blocks=64)
    png = io.BytesIO()
    WIDE.save(png, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_url, by_pil = (llm.chat([{"role": "user", "content": [{"type": "text", "text": "See"}, part]}], params,
                               use_tqdm=False)[0]
                      for part in ({"type": "image_url", "image_url": {"url": data_url}},
                                   {"type": "image_pil", "image_pil": WIDE}))
    ids = llm.llm_engine.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "See"},
                                                                             {"type": "image"}]}])
    direct = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": WIDE}}], params, use_tqdm=False)[0]
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages.0.content.1: fetching images from 'example.com'"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "See"},
                                               {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])


def test_the_encoder_budget_spreads_images_over_steps(llava):
    """max_num_encoder_input_tokens=16 (one image's embeddings): four prompts with four new images prefill
    over four steps, one image encoded in each, to the tokens an unbudgeted engine gives."""
    prompts = [{"prompt": f"Image {i}: <image> shows", "multi_modal_data": {"image": image}}
               for i, image in enumerate([RED, WIDE, TALL, _image(4, 50, 50)])]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=256, num_kv_blocks=128)
    expected = [o.outputs[0].token_ids for o in LLM(str(llava), **engine).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(llava), **engine, max_num_encoder_input_tokens=16)
    cache = llm.llm_engine.core.batch_builder.encoder_cache
    encoded_per_step = []
    plan = cache.plan

    def recording_plan(needed):
        encode, evict = plan(needed)
        encoded_per_step.append(len(encode))
        return encode, evict

    cache.plan = recording_plan
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert encoded_per_step[:4] == [1, 1, 1, 1] and cache.num_encoded == 4
