"""Chat messages -> the prompt's token ids (``POST /v1/chat/completions``).

The template is the tokenizer's own when it has one: a Hugging Face tokenizer folder whose
``tokenizer_config.json`` holds a ``chat_template`` (a Jinja text, or a list of named ones: the
one named "default"), or that has a ``chat_template.jinja`` file. It is rendered as
``transformers``' ``apply_chat_template`` renders it (a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``; variables ``messages``, ``add_generation_prompt`` true,
``bos_token``, ``eos_token``; ``raise_exception`` and ``strftime_now``), and the text is
tokenized as every request text is (its special tokens' pieces become those tokens).

Otherwise (sentencepiece, GPT-2 BPE, or a tokenizer without a template) the default template is
the layout megaloop's instruction tuning trains (``--data-format sft``,
megaloop/data/sft_examples.py), so a model tuned by megaloop is asked as it was taught: for every
message the tokens of ``"<role>:"`` then those of its content (each encoded on its own), the
end-of-document token after every assistant message, and last the tokens of ``"assistant:"``,
after which the model writes its answer and ends it with the end-of-document token. E.g.
``[{"role": "user", "content": " 2 + 3 ?"}]`` is ``tok("user:") + tok(" 2 + 3 ?") +
tok("assistant:")``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Callable, Optional

from megaloop.data.sft_examples import ASSISTANT, assemble, sft_segments


def tokenizer_template(tokenizer) -> Optional[str]:
    """The Jinja chat template shipped with ``tokenizer``'s files, or None."""
    model_file = getattr(tokenizer, "model_file", None)
    if not model_file or not model_file.endswith(".json"):
        return None  # only Hugging Face tokenizer folders carry a template
    folder = os.path.dirname(model_file)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    config = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # named templates: the default one is for chat
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    """Renders messages ([{role, content}] with text contents) into prompt token ids."""

    def __init__(self, tokenizer, tokenize: Callable[[str], list[int]]):
        """``tokenize``: how a request's text becomes ids (the server's one rule for special
        tokens)."""
        self.tokenizer, self.tokenize = tokenizer, tokenize
        source = tokenizer_template(tokenizer)
        self.kind = "tokenizer" if source is not None else "default"
        self._jinja = _compile(source) if source is not None else None

    def ids(self, messages: list[dict]) -> list[int]:
        if self._jinja is None:
            segments = sft_segments({"messages": messages}) + [(ASSISTANT + ":", False, False)]
            return assemble(segments, [self.tokenize(text) for text, _, _ in segments],
                            self.tokenizer.eod)[0]
        return self.tokenize(self.render(messages))

    def render(self, messages: list[dict]) -> str:
        """The template's text (tokenizer templates only)."""
        piece = self.tokenizer.piece
        bos = self.tokenizer.bos
        return self._jinja.render(messages=messages, add_generation_prompt=True,
                                  bos_token=piece(bos) if bos is not None else "",
                                  eos_token=piece(self.tokenizer.eod))


def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
