"""The served checkpoint's chat template, for ``/v1/chat/completions``: read from its tokenizer
files on local disk (never downloaded) and applied by ``transformers`` (its
``apply_chat_template``, the reference implementation of Hugging Face chat templates).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from wavepp.gateway.validation import ChatTemplate, Messages

log = logging.getLogger(__name__)


def has_chat_template(directory: Path) -> bool:
    """Whether ``directory`` holds a chat template: ``chat_template.jinja``, or a
    ``chat_template`` in ``tokenizer_config.json``."""
    if (directory / "chat_template.jinja").is_file():
        return True
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def load_chat_template(path: str) -> ChatTemplate | None:
    """messages -> token ids of the conversation with the generation prompt added, for the
    tokenizer at ``path`` (a folder, or a ``tokenizer.json`` whose folder is read); None when
    there is no chat template there or ``transformers`` is not installed (logged: chat
    requests are then refused with the reason)."""
    directory = Path(path)
    directory = directory if directory.is_dir() else directory.parent
    if not has_chat_template(directory):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("chat template in %s not used: transformers is not installed", directory)
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)

    def apply(messages: Messages) -> list[int]:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(i) for i in ids]

    return apply
