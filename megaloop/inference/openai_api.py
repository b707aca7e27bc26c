"""The request bodies tools/serve.py accepts (OpenAI's completions and chat completions, vLLM's
tokenizer endpoints) and which fields they may hold.

A field is either implemented, accepted only at its default value, or refused: a request that
sends a field this server does not know (``tools``, ``suffix``, a misspelt ``temprature``...) or a
value it does not implement (``presence_penalty`` 0.5) gets HTTP 400 naming the field, never an
answer that silently ignores it. Accepted at their defaults only, because clients send them
with those values (lm-evaluation-harness passes a task's generation arguments through; SDKs
fill some in): ``presence_penalty`` and ``frequency_penalty`` 0, ``logit_bias`` empty,
``best_of`` 1 and ``suffix`` empty (completions), ``tools`` empty, ``tool_choice`` "none",
``parallel_tool_calls``, ``response_format`` ``{"type": "text"}`` and ``store`` false (chat).
``user`` is accepted and written to the request's log line (that is what it is for: telling end
users apart). ``ignore_eos`` (vLLM's extension, both endpoints): true generates past the
end-of-document token up to ``max_tokens``. Standard library and pydantic only.
"""

from __future__ import annotations

from typing import Any, ClassVar, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

MAX_LOGPROBS = 20


class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    """A last chunk with ``choices: []`` and the request's ``usage``."""


# field -> the values accepted (its defaults); anything else is refused by name.
_DEFAULT_ONLY = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # says how tools run; there are none
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
}


class _Body(BaseModel):
    """Fields common to both generation endpoints."""

    # Extra fields are collected and refused by ``refuse_unknown`` with one message naming all.
    # JSON's Infinity and NaN (which Python's parser reads) are refused as numbers: no field
    # means anything by them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    DEFAULT_ONLY: ClassVar[tuple] = ()  # the fields of _DEFAULT_ONLY this endpoint knows

    model: Optional[StrictStr] = None
    # Ranges are checked by megaloop.inference.flags.check_sampling, as on generate.py's
    # command line (one message for one mistake, wherever it is made).
    temperature: Optional[StrictFloat] = 1.0
    top_p: Optional[StrictFloat] = 1.0
    top_k: Optional[StrictInt] = 0  # an extension (vLLM's): 0 = every token
    seed: Optional[StrictInt] = None  # range: flags.check_seed (what torch's generators take)
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    n: Optional[StrictInt] = Field(1, ge=1)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    # vLLM's extension: generate past the end-of-document token, to max_tokens (fixed output
    # lengths, e.g. for a benchmark); that token is then text as any other.
    ignore_eos: Optional[StrictBool] = False

    def refuse_unknown(self) -> None:
        extra = dict(self.model_extra or {})
        unknown = sorted(k for k in extra if k not in self.DEFAULT_ONLY)
        if unknown:
            raise RequestError(400, f"unsupported field{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(unknown)}: this server does not implement "
                                    f"{'them' if len(unknown) > 1 else 'it'}; leave "
                                    f"{'them' if len(unknown) > 1 else 'it'} out", unknown[0])
        for name, value in extra.items():
            accepted = _DEFAULT_ONLY[name]
            # (True == 1 in Python: a boolean is not a number here)
            if not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                       for a in accepted):
                shown = ", ".join("null" if a is None else repr(a) for a in accepted)
                given = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise RequestError(400, f"{name} {given}: not implemented by this server, "
                                        f"which accepts only {shown}", name)
        if self.stream_options is not None and not self.stream:
            raise RequestError(400, "stream_options is only for stream: true", "stream_options")


class CompletionRequest(_Body):
    """The body of ``POST /v1/completions`` (the legacy completions API)."""

    DEFAULT_ONLY: ClassVar[tuple] = ("presence_penalty", "frequency_penalty", "logit_bias",
                                     "best_of", "suffix")

    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    # A text, or a list of text parts (joined; other part types, e.g. images, are refused).
    content: Union[StrictStr, List[TextPart]]
    name: Optional[StrictStr] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)


class ChatCompletionRequest(_Body):
    """The body of ``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name
    of ``max_tokens`` (give one, or both equal); neither: what is left of the model's context
    after the prompt, within ``--max-request-tokens``."""

    DEFAULT_ONLY: ClassVar[tuple] = ("presence_penalty", "frequency_penalty", "logit_bias",
                                     "tools", "tool_choice", "parallel_tool_calls",
                                     "response_format", "store")

    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    logprobs: Optional[StrictBool] = False
    """True: each answer token's log-prob (``choices[].logprobs.content``; not with stream)."""
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    """With ``logprobs``: the N most likely tokens at each position too."""

    def logprobs_n(self) -> Optional[int]:
        """None: no log-probs; else how many top tokens per position."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> Optional[int]:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise RequestError(400, f"max_tokens {a} and max_completion_tokens {b} differ: they "
                                    f"are two names of one value, give one", "max_tokens")
        return a if a is not None else b


class TokenizeRequest(BaseModel):
    """The body of ``POST /tokenize`` (vLLM's form, which lm-eval's remote tokenizer sends)."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = False
    """True: the BOS token first, where the tokenizer has one (as a Hugging Face tokenizer's
    template adds it)."""


class DetokenizeRequest(BaseModel):
    """The body of ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    tokens: List[StrictInt]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object: a prompt counts once however many choices (``n``) it has;
    completion tokens are every token generated, a stop string's and the end-of-document
    token included (what the model computed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
