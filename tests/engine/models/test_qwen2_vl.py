"""Qwen2.5-VL and Qwen2-VL (engine/models/qwen2_vl.py) offline: greedy tokens and logprobs equal to Hugging
Face's `generate` on the same random weights, with images of several sizes and aspect ratios (so windows and
grids differ), two in one prompt, the same one twice, and text only; in the default, no-prefix-cache and
chunked modes (a chunk boundary inside an image's tokens, so M-RoPE positions and embeddings are sliced);
tensor parallel; and M-RoPE positions equal to Hugging Face's get_rope_index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.multimodal.mrope import mrope_positions
from tests.conftest import write_qwen_vl_checkpoint
from tests.parity import assert_output_matches, assert_tokens_match

TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# Patch grids (8-pixel patches): 4 x 4; 4 x 12 (three windows across); 10 x 4 (three down, the last cut short).
SMALL, WIDE, TALL = _image(1, 30, 30), _image(2, 40, 90), _image(3, 80, 30)
CASES = {
    "one image": (f"<|im_start|>user\nDescribe {PAD} briefly.<|im_end|>\n<|im_start|>assistant\n", [WIDE]),
    "two sizes": (f"Compare {PAD} with {PAD}, please.", [TALL, SMALL]),
    "same image twice": (f"{PAD}{PAD} the same?", [WIDE, WIDE]),
    "text only": ("No image here, only words.", []),
}


def _hf(model, path: Path, prompt: str, images: list) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Hugging Face's greedy tokens and each step's log_softmax, its placeholders expanded as its processor
    would (that processor class needs torchvision; its image processor and tokenizer do not)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    kwargs = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
        counts = iter((processed["image_grid_thw"].prod(-1) // 4).tolist())
        prompt = prompt.replace("<|image_pad|>", "<|placeholder|>")
        while "<|placeholder|>" in prompt:
            prompt = prompt.replace("<|placeholder|>", "<|image_pad|>" * next(counts), 1)
        kwargs = dict(processed)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == pad).int(), **kwargs,
                         max_new_tokens=TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return ids[0].tolist(), out.sequences[0, ids.shape[1]:].tolist(), [x[0].float().log_softmax(-1) for x in out.logits]


def _references(path: Path, cases: dict) -> dict[str, tuple]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return {name: _hf(model, path, prompt, images) for name, (prompt, images) in cases.items()}


def _check(llm: LLM, references: dict, cases: dict) -> list:
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in cases.values()]
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False)  # twice: the second round from the prefix cache
    for name, out in zip(list(cases) * 2, outputs):
        assert_output_matches(out, references[name], what=name)
    return outputs


@pytest.fixture(scope="module")
def references(qwen2_5_vl_checkpoint) -> dict[str, tuple]:
    return _references(qwen2_5_vl_checkpoint, CASES)


ENGINE = dict(dtype="float32", max_model_len=512, num_kv_blocks=256)


@pytest.mark.parametrize("mode", [{}, {"enable_prefix_caching": False},
                                  {"max_num_batched_tokens": 8, "block_size": 4}])  # chunks cut through images
def test_qwen2_5_vl_equals_hugging_face(qwen2_5_vl_checkpoint, references, mode):
    _check(LLM(str(qwen2_5_vl_checkpoint), **(ENGINE | mode)), references, CASES)


def test_qwen2_vl_equals_hugging_face(tmp_path):
    """Qwen2-VL: LayerNorm, fc1/fc2 and no windows in the tower; the rest as Qwen2.5-VL."""
    path = write_qwen_vl_checkpoint(tmp_path, generation="2")
    cases = {name: CASES[name] for name in ("two sizes", "same image twice")}
    _check(LLM(str(path), **ENGINE), _references(path, cases), cases)


def test_tensor_parallel_equals_one_rank(qwen2_5_vl_checkpoint, references):
    """The tower whole on each rank, the language model split: TP=2 gives Hugging Face's tokens too."""
    llm = LLM(str(qwen2_5_vl_checkpoint), **ENGINE, tensor_parallel_size=2)
    try:
        _check(llm, references, CASES)
    finally:
        llm.shutdown()


def test_mrope_positions_equal_hugging_face(qwen2_5_vl_checkpoint):
    """Every token's three positions, and the delta decode continues from, from any start: as get_rope_index."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    llm_engine = LLM(str(qwen2_5_vl_checkpoint), **ENGINE).llm_engine
    prompt, images = CASES["two sizes"]
    request = llm_engine.prepare_request(prompt, multi_modal_data={"image": images})
    ids = torch.tensor([request.prompt_token_ids])
    config = Qwen2_5_VLConfig.from_pretrained(qwen2_5_vl_checkpoint)
    with torch.device("meta"):
        model = Qwen2_5_VLModel(config)
    grids = torch.tensor([image.grid_thw for image in request.mm_inputs])
    expected, delta = model.get_rope_index(ids, (ids == config.image_token_id).int(), image_grid_thw=grids)
    n = ids.shape[1]
    assert (mrope_positions(request.mm_inputs, 2, 0, n) == expected[:, 0].numpy()).all()
    for start in (3, request.mm_inputs[0].offset + 5, request.mm_inputs[1].end - 1):  # chunks from inside images
        assert (mrope_positions(request.mm_inputs, 2, start, n - start) == expected[:, 0, start:].numpy()).all()
    decode = mrope_positions(request.mm_inputs, 2, n + 4, 1)
    assert (decode == n + 4 + int(delta)).all()


def test_builtin_model_chats_with_images_and_refuses_what_it_lacks():
    """pagedserve-tiny-qwen2.5-vl (its processor, ChatML template and tokens written by the engine): a chat's
    image part gives the tokens of its chat template's ids with the image; what is not built is refused."""
    llm = LLM("pagedserve-tiny-qwen2.5-vl", max_model_len=512, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    image = {"type": "image_pil", "image_pil": TALL}
    messages = [{"role": "user", "content": [{"type": "text", "text": "See"}, image]}]
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    ids = llm.llm_engine.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "See"},
                                                                           {"type": "image"}]}])
    direct = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": TALL}}], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.prompt_token_ids.count(32004) == 8  # 80 x 30 pixels: resized to 112 x 56, 8 x 4 patches, 4 x 2 squares
    with pytest.raises(ValueError, match="multi_modal_data: video not supported"):
        llm.llm_engine.prepare_request(f"{PAD}", multi_modal_data={"video": [TALL]})
    with pytest.raises(ValueError, match="enable_lora: .*Qwen2_5_VLForConditionalGeneration"):
        LLM("pagedserve-tiny-qwen2.5-vl", max_model_len=256, num_kv_blocks=64, enable_lora=True)


def test_processed_images_are_cached_by_content(qwen2_5_vl_checkpoint):
    """The same pixels again (another PIL object) skip the image processor; another image or other processor
    settings do not; with the cache off, nothing is kept. The prepared inputs are the same either way."""
    llm = LLM(str(qwen2_5_vl_checkpoint), **ENGINE)
    processor = llm.llm_engine.input_processor
    cache = processor.processed_images
    prompt = f"See {PAD}"
    first = processor.prepare_request(prompt, multi_modal_data={"image": WIDE})
    again = processor.prepare_request(prompt, multi_modal_data={"image": WIDE.copy()})
    assert (cache.queries, cache.hits) == (2, 1)
    assert (again.mm_inputs[0].pixel_values == first.mm_inputs[0].pixel_values).all()
    processor.prepare_request(prompt, multi_modal_data={"image": TALL})
    assert (cache.queries, cache.hits) == (3, 1)
    off = LLM(str(qwen2_5_vl_checkpoint), **ENGINE, mm_processor_cache_gb=0).llm_engine.input_processor
    assert off.processed_images is None
    uncached = off.prepare_request(prompt, multi_modal_data={"image": WIDE})
    assert uncached.prompt_token_ids == first.prompt_token_ids
    assert (uncached.mm_inputs[0].pixel_values == first.mm_inputs[0].pixel_values).all()


def test_images_with_preemption_speculative_decoding_structured_outputs_and_prompt_logprobs(
        qwen2_5_vl_checkpoint, references):
    """The pairs the README's table states as supported: a KV pool too small for every request at once
    (requests preempted and recomputed, their images re-encoded or read back); n-gram speculative decoding
    (drafts verified at their M-RoPE positions); a grammar on the output; prompt logprobs over image tokens."""
    from engine.sampling_params import StructuredOutputsParams

    prompts = [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in CASES.values()]
    tight = LLM(str(qwen2_5_vl_checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=10, block_size=16,
                enable_prefix_caching=False)
    outputs = tight.generate(prompts * 3, GREEDY, use_tqdm=False)
    assert tight.llm_engine.core.get_stats().num_preemptions > 0
    for name, out in zip(list(CASES) * 3, outputs):
        assert_tokens_match(out.outputs[0].token_ids, references[name][1], references[name][2], what=name)
    ngram = LLM(str(qwen2_5_vl_checkpoint), **ENGINE,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    for name, out in zip(CASES, ngram.generate(prompts, GREEDY, use_tqdm=False)):
        assert_tokens_match(out.outputs[0].token_ids, references[name][1], references[name][2], what=name)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]))
    out = ngram.generate(prompts[:1], params, use_tqdm=False)[0]
    assert out.outputs[0].text in ("cat", "dog")
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
