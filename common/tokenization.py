"""Prompt encoding shared by the CLI and the router: chat template or raw text, one way everywhere."""

from __future__ import annotations

from common.errors import InvalidRequestError


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of `prompt`: as is with `raw`, else as the user turn of the model's chat template."""
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt", "must be a non-empty string")
    if raw:
        return list(tokenizer(prompt)["input_ids"])
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    if not messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
