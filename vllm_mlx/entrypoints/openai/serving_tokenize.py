"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, and its chat
template exactly as a chat completion renders it (tools and images included)."""

from __future__ import annotations

from vllm_mlx.engine.input_processor import PreparedPrompt
from vllm_mlx.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from vllm_mlx.entrypoints.openai.serving import OpenAIError
from vllm_mlx.entrypoints.openai.serving_chat import ChatServing


class TokenizeServing:
    """The two endpoints over the chat serving's tokenizer, template and limits."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """``{"count", "max_model_len", "tokens"}`` of a ``prompt`` or of chat ``messages``."""
        chat = self.chat
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "Give either prompt or messages.", param="prompt")
        if body.prompt is not None:
            chat.check_text_fits(body.prompt, param="prompt")
            token_ids = await chat.run_tokenizer(
                lambda text: list(chat.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)),
                body.prompt, chars=len(body.prompt),
            )  # fmt: skip
        else:
            request = ChatCompletionRequest(
                model=body.model, messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt
            )
            _, prompt = await chat.render(request)
            token_ids = prompt.token_ids if isinstance(prompt, PreparedPrompt) else prompt
        return {"count": len(token_ids), "max_model_len": chat.info.max_model_len, "tokens": token_ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """``{"prompt"}``: the text of token ids of the vocabulary."""
        chat = self.chat
        chat.check_model(body.model)
        vocab = chat.info.vocab_size
        if any(t < 0 or (vocab is not None and t >= vocab) for t in body.tokens):
            raise OpenAIError(400, f"tokens must be ids of the vocabulary (0 to {vocab - 1 if vocab else '...'})",
                              param="tokens")  # fmt: skip
        text = await chat.run_tokenizer(chat.tokenizer.decode, body.tokens, chars=len(body.tokens))
        return {"prompt": text}
