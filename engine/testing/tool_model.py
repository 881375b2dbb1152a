"""A tiny random-weight model whose chat template renders tools (Hermes / Qwen2.5 style), for tests.

The demo model's template knows no tools; this copy of `build_tiny_model`'s qwen2 model gets a
template of our own that lists the tools in a system turn, renders an assistant's calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and a tool's answer as
`<tool_response>...</tool_response>`: the format the router parses with `tool_choice: auto`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from common.model_files import cache_root
from engine.testing.tiny_models import build_tiny_model

TOOL_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Answer a call as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}
<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tool_model(target: str | Path | None = None) -> Path:
    """Save (once) and return the tiny qwen2 model with TOOL_CHAT_TEMPLATE as its chat template."""
    from transformers import AutoTokenizer

    target = Path(target) if target else cache_root() / "models" / "tiny-qwen2-tools"
    if (target / "config.json").exists():
        return target
    source = build_tiny_model(arch="qwen2")
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    for stale in staging.glob("chat_template.*"):
        stale.unlink()
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return target
