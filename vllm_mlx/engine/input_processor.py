"""Input processing: a caller's prompt and ``SamplingParams`` become the engine's ``Request``s.

``InputProcessor`` encodes prompts with the tokenizer, loads and preprocesses images
(``prepare_prompt``), compiles structured-output constraints, validates what ``SamplingParams``
cannot check alone (token ids against the vocabulary, strings hashed into block keys), and
splits an ``n > 1`` request into ``n`` sibling ``Request``s with consecutive seeds.

Plain Python and the tokenizer: no forward pass, no MLX work on the model's data.
``prepare_prompt``, ``check_images`` and ``compile_constraint`` may run on any thread (the server
and ``AsyncEngineCore`` call them off the engine thread); ``process`` draws seeds from one random
generator and runs on the engine thread, inside ``EngineCore.add_request``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_mlx.core.multimodal import MultiModalInput
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.engine.chat import template_image_text
from vllm_mlx.multimodal.images import ImageSource
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import ImageInputError
from vllm_mlx.platform.validation import check_encodable
from vllm_mlx.structured.grammar import CompiledGrammar, GrammarCompiler
from vllm_mlx.structured.matcher import RequestConstraint
from vllm_mlx.structured.reasoning_gate import ReasoningGate, ThinkTokens

if TYPE_CHECKING:
    from vllm_mlx.config import EngineConfig
    from vllm_mlx.multimodal.vlm_models import VisionLanguageModel


@dataclass
class PreparedPrompt:
    """A prompt ready for the scheduler: token ids (image placeholders expanded) and images.

    ``error`` is set when the prompt's images cannot be used: the request then finishes at once
    with that message, alone.
    """

    text: str | None
    token_ids: list[int]
    mm_input: MultiModalInput | None = None
    error: str | None = None


@dataclass
class ProcessedRequest:
    """A caller's request as the engine queues it: ``requests`` holds its ``params.n``
    completions (the request's own id for ``n == 1``, else ``"<id>#<index>"``), which share
    the prompt; ``requests[0]`` is the leader whose prefill its siblings reuse."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    requests: list[Request]


class InputProcessor:
    """Prepares requests for one model: its tokenizer, vocabulary, vision adapter and EOS ids.

    Args:
        config: The engine's settings: ``media_policy`` (read at each call, the default for
            ``prepare_prompt``) and ``seed`` (seeds the per-request seeds drawn when a request
            brings none).
        tokenizer: The model's tokenizer (``encode``, ``eos_token_ids``).
        model_config: The model's config dict (the vocabulary size is read from it).
        vision: The vision-language adapter, or None for a text model.
    """

    def __init__(
        self, config: EngineConfig, tokenizer: Any, model_config: dict, vision: VisionLanguageModel | None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.vision = vision
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, self.eos_token_ids, max_bound=config.max_constraint_bound)
        self.think_tokens = ThinkTokens.of(tokenizer)
        self._seed_rng = random.Random(config.seed)

    @functools.cached_property
    def image_text(self) -> str:
        """What one image looks like in a text prompt written without the chat template: what
        the template writes for an image part (so a bare prompt reads as the model was trained),
        else the adapter's placeholder text; only if it holds the adapter's placeholder token."""
        text = template_image_text(self.tokenizer)
        placeholder = self.vision.placeholder_token_id
        if text is not None and placeholder in self._image_prompt_ids(text):
            return text
        return self.vision.image_placeholder_text

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (from its config), or None when it does not say."""
        config = self.model_config.get("text_config", self.model_config)
        return config.get("vocab_size") or self.model_config.get("vocab_size")

    def process(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        images: Sequence[ImageSource] | None = None,
        fairness_key: str | None = None,
        constraint: CompiledGrammar | None = None,
        speculative: bool | None = None,
        lora_id: int = 0,
        lora_digest: str | None = None,
    ) -> ProcessedRequest:
        """Validate, encode and split one caller's request (see ``EngineCore.add_request`` for
        the arguments and the exceptions). A prompt whose images failed to load yields requests
        that are already finished with the error."""
        self.check_request(params, request_id, cache_salt, fairness_key)
        grammar = constraint or self.compile_constraint(params)
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare_prompt(prompt, images)
        gate = self.reasoning_gate(prepared.token_ids, params, grammar)
        # Drawn after validation, so a refused request leaves the seed sequence untouched.
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        requests = []
        for index in range(params.n):
            request = Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                prepared.token_ids, params.clone(n=1, seed=base_seed + index), prompt=prepared.text,
                eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, mm_input=prepared.mm_input,
                fairness_key=fairness_key or request_id,
                constraint=RequestConstraint(grammar, self.eos_token_ids) if grammar else None,
                reasoning_gate=gate, speculative=speculative, lora_id=lora_id, lora_digest=lora_digest,
            )  # fmt: skip
            if prepared.error is not None:
                request.error(prepared.error)
            requests.append(request)
        return ProcessedRequest(request_id, prepared.text, prepared.token_ids, params, requests)

    def check_request(
        self, params: SamplingParams, request_id: str, cache_salt: str | None, fairness_key: str | None
    ) -> None:
        """What ``SamplingParams`` cannot check alone: token ids against this model's vocabulary;
        strings that must encode as UTF-8 (they are hashed into block keys)."""
        vocab = self.vocab_size
        if vocab and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        check_encodable("request_id", request_id)
        if cache_salt is not None:
            if not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
            check_encodable("cache_salt", cache_salt)
        if fairness_key is not None:
            check_encodable("fairness_key", fairness_key)

    def reasoning_gate(
        self, prompt_token_ids: list[int], params: SamplingParams, grammar: CompiledGrammar | None
    ) -> ReasoningGate | None:
        """The gate of a request on a thinking model that has a constraint or a thinking budget."""
        think = self.think_tokens
        if params.max_thinking_tokens is not None and think is None:
            raise ValueError(
                "max_thinking_tokens needs a thinking model: this tokenizer has no single-token <think> and </think>"
            )
        if think is None or (grammar is None and params.max_thinking_tokens is None):
            return None
        return ReasoningGate(think, think.prompt_opens(prompt_token_ids), params.max_thinking_tokens)

    def compile_constraint(self, params: SamplingParams, max_bound: int | None = None) -> CompiledGrammar | None:
        """``params.structured_outputs`` compiled (None without one; cached by content);
        ``max_bound``: the largest repetition bound allowed (None: the compiler's default).
        Thread-safe, no MLX work; raises ``ConstraintError`` (a ``ValueError``)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs, max_bound)

    def prepare_prompt(
        self,
        prompt: str | list[int],
        images: Sequence[ImageSource] | None = None,
        *,
        media_policy: MediaPolicy | None = None,
    ) -> PreparedPrompt:
        """Tokenize ``prompt`` and load and preprocess its images under ``media_policy`` (default:
        the config's); no MLX work, so any thread. The contract is ``EngineCore.prepare_prompt``'s:
        a text prompt without placeholders gets one per image in front, and a bad image does not
        raise but is carried in ``PreparedPrompt.error``."""
        images = list(images or [])
        self.check_images(images)
        policy = media_policy or self.config.media_policy or MediaPolicy.operator()
        policy.check_image_count(len(images))
        text, token_ids = self.encode(prompt)
        if not images:  # a prefix LM's text prompt still attends both ways (``text_only_input``)
            mm_input = self.vision.text_only_input(len(token_ids)) if self.vision is not None else None
            return PreparedPrompt(text, token_ids, mm_input)
        if isinstance(prompt, str) and getattr(self.vision, "places_images_itself", False):
            # Its processor decides where images go, whatever the text says (mlx-vlm's generation too):
            # the prompt is the processor's own, each image one stand-in token for ``prepare`` to expand.
            try:
                token_ids = self.vision.layout_prompt_ids(prompt, len(images))
            except ValueError as exc:
                raise ValueError(f"this model {exc}") from None
        elif isinstance(prompt, str):
            token_ids = self._image_prompt_ids(prompt, token_ids)
            if self.vision.placeholder_token_id not in token_ids:
                text = self.image_text * len(images) + prompt
                token_ids = self._image_prompt_ids(text)
        try:
            expanded, mm_input = self.vision.prepare(token_ids, images, policy)
        except ImageInputError as exc:
            return PreparedPrompt(text, token_ids, error=str(exc))
        return PreparedPrompt(text, expanded, mm_input)

    def _image_prompt_ids(self, text: str, token_ids: list[int] | None = None) -> list[int]:
        """``text``'s ids with each image placeholder one token: a placeholder of several tokens
        (InternVL's ``<image>``) is replaced before tokenizing (``prompt_text``), as the processor
        replaces it; ``token_ids``: ``text``'s own ids, kept where nothing is replaced."""
        tokenized = self.vision.prompt_text(self._wrapped_as_the_processor_wraps(text))
        if token_ids is not None and tokenized == text:
            return token_ids
        return self.encode(tokenized)[1]

    def _wrapped_as_the_processor_wraps(self, text: str) -> str:
        """``text`` in one user turn of the chat template where the model's processor wraps it so
        (``VisionLanguageModel.chat_wrap_unless``), rendered in the guarded template workers."""
        mark = self.vision.chat_wrap_unless
        if mark is None or mark in text or not getattr(self.tokenizer, "chat_template", None):
            return text
        from vllm_mlx.engine.template_guard import template_guard

        messages = [{"role": "user", "content": text}]
        return template_guard().render(self.tokenizer, messages, add_generation_prompt=True, tools=None)

    def check_images(self, images: Sequence[ImageSource]) -> None:
        """Raise ``ValueError`` if there are images and the model is text-only, or more of them than
        the model takes (before a chat template, which may not accept image parts at all, sees them)."""
        if images and self.vision is None:
            raise ValueError("this model is text-only; image inputs need a vision-language model")
        if images:  # a family that takes fewer images a prompt than the policy allows (PaddleOCR-VL: one)
            self.vision.check_image_count(len(images))

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A text prompt's text and token ids, or (None, the ids) after checking their range."""
        if isinstance(prompt, str):
            check_encodable("prompt", prompt)
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        token_ids = [int(t) for t in prompt]
        vocab = self.vocab_size
        if vocab and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, token_ids
