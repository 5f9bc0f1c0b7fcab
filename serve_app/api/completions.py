"""POST /v1/completions: one prompt (text or token ids) and the text completion built
from the engine's outputs."""

from typing import Dict, Iterable, List, Literal, NamedTuple, Optional, Tuple, Union

from pydantic import BaseModel, Field, field_validator

from mlx_worker.request import RequestOutput

from .openai_common import (
    Decode,
    FinishReason,
    Usage,
    _logprobs,
    _lp,
    _now,
    _Request,
    _tok,
    finish_reason,
    merge_outputs,
    random_id,
    usage,
)


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, text or token ids."""

    prompt: Union[str, List[int]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None  # k: the sampled token's logprob plus the top k
    echo: Optional[bool] = False  # the prompt before the completion (with logprobs: the prompt's too)
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, list) and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise ValueError("must be a string or a list of token ids (non-negative integers)")
        if not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of token ids")
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("not supported")
        return v


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[Optional[float]]  # an echoed prompt's first token has none
    top_logprobs: Optional[List[Optional[Dict[str, float]]]] = None
    text_offset: List[int]

    def __add__(self, other: "CompletionLogprobs") -> "CompletionLogprobs":
        top = None if self.top_logprobs is None and other.top_logprobs is None else \
            (self.top_logprobs or [None] * len(self.tokens)) + (other.top_logprobs or [None] * len(other.tokens))
        return CompletionLogprobs(tokens=self.tokens + other.tokens, token_logprobs=self.token_logprobs + other.token_logprobs,
                                  top_logprobs=top, text_offset=self.text_offset + other.text_offset)


class Echo(NamedTuple):
    """The prompt of an echo request: its text and token ids."""

    text: str
    ids: List[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[FinishReason] = None  # null in streamed chunks until the last
    logprobs: Optional[CompletionLogprobs] = None


class Completion(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


CompletionChunk = Completion  # OpenAI streams text completions as the same object


def completion_logprobs(token_ids: List[int], logprobs: Optional[List[Optional[float]]],
                        top_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]], decode: Decode,
                        text_offset: int = 0) -> CompletionLogprobs:
    """Legacy `logprobs` (tokens, token_logprobs, top_logprobs, text_offset); `text_offset`
    is where these tokens' text starts (the length of the text before them). A None entry
    (an echoed prompt's first token) stays None."""
    cache: dict = {}
    tokens = [_tok(decode, cache, t)[0] for t in token_ids[: len(logprobs or [])]]
    offsets = []
    for s in tokens:
        offsets.append(text_offset)
        text_offset += len(s)
    tops = [None if row is None else {_tok(decode, cache, t)[0]: _lp(l) for t, l in row}
            for row in top_logprobs] if top_logprobs else None
    return CompletionLogprobs(tokens=tokens, token_logprobs=[None if x is None else _lp(x) for x in logprobs or []],
                              top_logprobs=tops, text_offset=offsets)


def _echoed(o: RequestOutput, decode: Optional[Decode], echo: Echo) -> Tuple[str, Optional[CompletionLogprobs]]:
    """A sample's text and logprobs with its prompt (and the prompt's logprobs) before it."""
    done = _logprobs(completion_logprobs, o, decode, len(echo.text))
    if o.prompt_logprobs is None or decode is None:
        return echo.text + o.text, done
    prompt = completion_logprobs(echo.ids, o.prompt_logprobs, o.prompt_top_logprobs, decode)
    return echo.text + o.text, prompt + done if done is not None else prompt


def completion(outputs: Iterable[RequestOutput], model: str, decode: Optional[Decode] = None,
               id: Optional[str] = None, created: Optional[int] = None, echo: Optional[Echo] = None) -> Completion:
    """The non-streamed text completion from all of a request's outputs (`echo`: the
    prompt goes first)."""
    outs, choices = merge_outputs(outputs), []
    for o in outs:
        text, lp = _echoed(o, decode, echo) if echo else (o.text, _logprobs(completion_logprobs, o, decode))
        choices.append(CompletionChoice(index=o.index, text=text, logprobs=lp,
                                        finish_reason=finish_reason(o.finish_reason) or "stop"))
    return Completion(id=id or random_id("cmpl"), created=created or _now(), model=model, choices=choices,
                      usage=usage(outs))


def completion_chunk(out: RequestOutput, id: str, created: int, model: str, decode: Optional[Decode] = None,
                     text_offset: int = 0, echo: Optional[Echo] = None) -> CompletionChunk:
    """One streamed piece of sample `out.index`; `text_offset`: that sample's text length
    so far; `echo`: the sample's first piece, with the prompt before it."""
    text, lp = _echoed(out, decode, echo) if echo else (out.text, _logprobs(completion_logprobs, out, decode, text_offset))
    choice = CompletionChoice(index=out.index, text=text, logprobs=lp,
                              finish_reason=finish_reason(out.finish_reason) if out.finished else None)
    return Completion(id=id, created=created, model=model, choices=[choice])
