"""The router's view of the model: its tokenizer and context length, loaded without torch.

transformers' Auto* classes import its config machinery, which loads torch (~1.4 s, hundreds of MB);
the router needs neither weights nor configs as objects. The tokenizer comes from the model's
tokenizer.json and tokenizer_config.json (chat template, special tokens) through transformers'
fast-tokenizer class, which the workers' AutoTokenizer resolves to as well for tokenizer.json
models; the context length from config.json, or a GGUF file's metadata.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from common.errors import ModelLoadError
from common.model_files import model_config, resolve_model_path, split_gguf


def load_tokenizer_and_context(model: str, max_model_len: int | None):
    """(tokenizer, context length) of a model reference: `max_model_len` when set, else the model's own."""
    path = resolve_model_path(model)
    directory, kwargs = split_gguf(path)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError("model", f"could not load the tokenizer of {model!r}: {exc}") from exc
    return tokenizer, max_model_len or context_length(path)


def context_length(path: str) -> int:
    """max_position_embeddings of an HF directory (or its text model's), or a GGUF file's `<arch>.context_length`."""
    if path.endswith(".gguf"):
        return _gguf_context_length(path)
    config = model_config(path)
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if not isinstance(value, int):
        raise ModelLoadError("engine.max_model_len", f"{path}/config.json has no max_position_embeddings: set engine.max_model_len")
    return value


def _gguf_context_length(path: str) -> int:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = fields.get("general.architecture")
    length = fields.get(f"{bytes(arch.parts[arch.data[0]]).decode()}.context_length") if arch is not None else None
    if length is None:
        raise ModelLoadError("engine.max_model_len", f"{path} has no context_length in its metadata: set engine.max_model_len")
    return int(length.parts[length.data[0]][0])
