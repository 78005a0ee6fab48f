"""LLM: offline batch generation, vLLM's `LLM` API without Ray."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tqdm import tqdm

from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.multimodal.media import MediaSettings, load_images, split_image_parts
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling.params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from engine.frontend.data_parallel import DataParallelEngine

# Text or token ids, or vLLM's dict: {"prompt": text} or {"prompt_token_ids": ids}, with "multi_modal_data".
PromptType = str | list[int] | dict


class LLM:
    """`LLM("pagedserve-tiny", max_model_len=1024).generate(["Hello"], SamplingParams(max_tokens=8))`.
    Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str, media: MediaSettings | None = None, **engine_config) -> None:
        """`media`: what image URLs in `chat` may name (data: URLs only by default). With data_parallel_size > 1
        (MoE models) the DP ranks' engines run in processes of their own (engine/frontend/data_parallel.py)."""
        config = EngineConfig(model=model, **engine_config)
        if config.data_parallel_size > 1:
            from engine.frontend.data_parallel import DataParallelEngine

            self.llm_engine: LLMEngine | DataParallelEngine = DataParallelEngine(config)
        else:
            self.llm_engine = LLMEngine(config)
        self.media = media or MediaSettings()

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-rank engine (and a data-parallel group's engine processes); they
        also stop when this process exits."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order. `lora_request`:
        one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt("sampling_params", sampling_params or SamplingParams(), SamplingParams,
                                  len(prompt_list))
        lora_list = _per_prompt("lora_request", lora_request, LoRARequest, len(prompt_list))
        engine = self.llm_engine
        # Validate everything before enqueuing anything: no half-submitted batch left running.
        prepared = []
        for prompt, params, lora in zip(prompt_list, params_list, lora_list):
            text, mm_data = _prompt_and_data(prompt)
            prepared.append(engine.prepare_request(
                text, params.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY}), lora_request=lora,
                multi_modal_data=mm_data))
        for p in prepared:  # read every adapter (a bad one raises) before anything is queued
            if p.lora_request is not None:
                engine.add_lora(p.lora_request)
        for p in prepared:
            engine.add_prepared(p)
        return self._run([p.request_id for p in prepared], use_tqdm)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Embed each prompt (text or token ids) with a model started with task='embed'; outputs come back in
        prompt order, each vector at `output.outputs.embedding`."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt("pooling_params", pooling_params or PoolingParams(), PoolingParams,
                                  len(prompt_list))
        engine = self.llm_engine
        prepared = []
        for prompt, params in zip(prompt_list, params_list):
            if isinstance(prompt, dict):
                raise ValueError("prompts: embed takes text or token ids")
            prepared.append(engine.prepare_request(prompt, pooling_params=params))
        for p in prepared:
            engine.add_prepared(p)
        return self._run([p.request_id for p in prepared], use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to several,
        through the tokenizer's chat template. Content parts may carry images: {"type": "image_url",
        "image_url": {"url": "data:..."}} (or a file: URL under media.allowed_local_media_path) or
        {"type": "image_pil", "image_pil": <PIL image>}."""
        if not messages:
            raise ValueError("messages: must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            conversation, sources = split_image_parts(conversation)
            images = load_images(sources, self.media) if sources else []
            ids = self.llm_engine.apply_chat_template(conversation, add_generation_prompt)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0
        wanted = set(ids)
        while len(outputs) < len(ids):
            if not engine.has_unfinished_requests():
                raise RuntimeError("the engine has no work left, yet some requests never finished")
            for output in engine.step():
                if output.request_id not in wanted or not output.finished:
                    continue
                outputs[output.request_id] = output
                bar.update(1)
                if isinstance(output, RequestOutput):
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.set_postfix_str(f"output {num_output_tokens / (time.perf_counter() - start):.0f} tok/s")
        bar.close()
        return [outputs[i] for i in ids]


def _per_prompt(name: str, value, cls: type, num_prompts: int) -> list:
    """One `cls` (or None) for every prompt, or one per prompt."""
    if value is None or isinstance(value, cls):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"{name}: got {len(values)} for {num_prompts} prompts; pass one, or one per prompt")
    return values


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: must not be empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt of token ids
    for p in prompts:
        if not isinstance(p, (str, list, tuple, dict)):
            raise ValueError(f"prompts: expected str, a list of token ids or a dict, got {type(p).__name__}")
    return [p if isinstance(p, (str, dict)) else list(p) for p in prompts]


def _prompt_and_data(prompt: PromptType) -> tuple[str | list[int], dict | None]:
    """(text or token ids, multi_modal_data) of a prompt; a dict is vLLM's shape."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompts: a dict prompt has 'prompt' (text) or 'prompt_token_ids', and may have "
                         f"'multi_modal_data'; got keys {sorted(prompt)}")
    text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return text, prompt.get("multi_modal_data")
