"""What the OpenAI-style APIs share: the sampling fields of a request and their
conversion to the engine's SamplingParams, usage, finish reasons, ids, and the merging of
a request's streamed engine outputs."""

import json
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlx_worker.request import RequestOutput
from mlx_worker.sampling.grammar import GrammarSpec
from mlx_worker.sampling.sampler import MAX_N, SamplingParams

from .errors import ProtocolError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")  # `schema` shadows BaseModel.schema
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object')
        return self


class _Request(BaseModel):
    """Fields shared by chat and text completions (and mapped onto by the other APIs)."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send extras; wrong types still fail

    model: Optional[str] = None
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = None  # vLLM: -1 or 0 is off
    min_p: Optional[float] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    min_tokens: Optional[int] = None
    stop: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[int, float]] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = Field(None, min_length=1)
    user: Optional[str] = None  # ignored

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):
        if not isinstance(v, dict):
            return v
        for k in v:
            if not (isinstance(k, int) or (isinstance(k, str) and k.strip().lstrip("-").isdigit())):
                raise ValueError(f"keys must be token ids (integers), got {k!r}")
        return {int(k): b for k, b in v.items()}

    @field_validator("guided_json", mode="before")
    @classmethod
    def _json_text(cls, v):
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
        return v

    @property
    def include_usage(self) -> bool:
        """Stream a final chunk with usage (stream_options.include_usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_PASSTHROUGH = ("temperature", "top_p", "min_p", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "n")


def grammar_spec(req: "_Request") -> Optional[GrammarSpec]:
    """The output constraint of response_format / guided_*; at most one may be given."""
    got = {}
    rf = req.response_format
    if rf is not None and rf.type != "text":
        schema = rf.json_schema.schema_ if rf.type == "json_schema" else None
        got["response_format"] = {"json_schema": schema} if schema is not None else {"json_object": True}
    if req.guided_json is not None:
        got["guided_json"] = {"json_schema": req.guided_json}
    if req.guided_regex is not None:
        got["guided_regex"] = {"regex": req.guided_regex}
    if req.guided_choice is not None:
        got["guided_choice"] = {"choice": req.guided_choice}
    if len(got) > 1:
        raise ProtocolError(f"only one of {', '.join(got)} may be given: each constrains the whole output",
                            param=list(got)[1])
    if not got:
        return None
    (name, spec), = got.items()
    try:
        return GrammarSpec(**spec)
    except ValidationError as e:
        raise ProtocolError(f"{name}: {e.errors()[0]['msg'].removeprefix('Value error, ')}", param=name) from None


def to_sampling_params(req: "_Request", default_max_tokens: int, max_model_len: Optional[int] = None,
                       num_prompt_tokens: int = 0, tool_grammar: Optional[GrammarSpec] = None) -> SamplingParams:
    """The engine's SamplingParams for a chat or text completion request.

    max_tokens: max_completion_tokens, else max_tokens, else `default_max_tokens`; with
    `max_model_len`, prompt + max_tokens must fit (a default is shrunk to fit).
    Raises `ProtocolError` (400) for anything invalid.
    """
    chat = hasattr(req, "messages")  # a chat request (or one mapped onto it)
    rename: Dict[str, str] = {}
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens, rename["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    if max_model_len is not None:
        room = max_model_len - num_prompt_tokens
        limit = f"This model's maximum context length is {max_model_len} tokens"
        if room < 1:
            raise ProtocolError(f"{limit}, but the prompt has {num_prompt_tokens} tokens",
                                param="messages" if chat else "prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ProtocolError(f"{limit}, but you requested {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in "
                                f"the prompt, {max_tokens} in the completion); reduce the prompt or max_tokens",
                                param=rename.get("max_tokens", "max_tokens"), code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
    kw = {k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}
    kw["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    scoring = getattr(req, "echo", False) and req.logprobs is not None  # max_tokens 0: score the prompt only
    if kw["max_tokens"] < (0 if scoring else 1):
        field = rename.get("max_tokens", "max_tokens")
        raise ProtocolError(f"{field}: Input should be greater than or equal to {0 if scoring else 1}", param=field)
    if req.top_k is not None:
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k  # vLLM's -1: off
    if req.seed is not None:
        kw["seed"] = req.seed % (2**32 - MAX_N)  # any int64 -> the engine's uint32 (+ sample index)
    if chat:
        if req.top_logprobs and not req.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        kw.update(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0)
    elif req.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=req.logprobs)
        rename["top_logprobs"] = "logprobs"
        if getattr(req, "echo", False):  # the prompt's logprobs too (lm-eval's loglikelihood)
            kw["prompt_logprobs"] = req.logprobs
    kw["structured"] = grammar_spec(req)
    if tool_grammar is not None:
        if kw["structured"] is not None:
            raise ProtocolError("tool_choice 'required' or a named function constrains the whole output: "
                                "it cannot be combined with response_format or guided_*", param="tool_choice")
        kw["structured"] = tool_grammar
    try:
        return SamplingParams(**kw)
    except ValidationError as e:
        raise ProtocolError.from_validation(e, rename) from None


def _json_or_text(s: str):
    try:
        return json.loads(s)
    except (TypeError, ValueError):
        return s


def random_id(prefix: str, sep: str = "-") -> str:
    """e.g. random_id("chatcmpl") -> "chatcmpl-3f2a..." (Anthropic's ids take "_")."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "macfarm"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard] = Field(default_factory=list)


# token id -> its text (or its raw bytes), e.g. `lambda t: tokenizer.decode([t])`
Decode = Callable[[int], Union[str, bytes]]


def _tok(decode: Decode, cache: dict, tid: int) -> Tuple[str, List[int]]:
    if tid not in cache:
        t = decode(tid)
        raw = t if isinstance(t, bytes) else t.encode("utf-8")
        cache[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
    return cache[tid]


def _lp(x: float) -> float:
    return max(float(x), -9999.0)  # JSON has no -inf


def finish_reason(reason: Optional[str]) -> Optional[FinishReason]:
    """The engine's finish reason in OpenAI's terms: length stays, stop/abort/error -> stop
    (errors are the ingress's to report: check `out.finish_reason == "error"` first)."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def merge_outputs(outputs: Iterable[RequestOutput]) -> List[RequestOutput]:
    """One RequestOutput per sample (sorted by index): streamed pieces concatenated,
    finish fields and token counts from the last piece."""
    by: Dict[int, List[RequestOutput]] = {}
    for o in outputs:
        by.setdefault(o.index, []).append(o)

    def cat(xs):
        return None if all(x is None for x in xs) else [v for x in xs if x for v in x]

    return [replace(parts[-1], token_ids=[t for o in parts for t in o.token_ids], text="".join(o.text for o in parts),
                    logprobs=cat([o.logprobs for o in parts]), top_logprobs=cat([o.top_logprobs for o in parts]),
                    prompt_logprobs=parts[0].prompt_logprobs, prompt_top_logprobs=parts[0].prompt_top_logprobs)
            for _, parts in sorted(by.items())]


def usage(outputs: Iterable[RequestOutput]) -> Usage:
    """Token usage of a request from its outputs (all, or each sample's last): the prompt
    counts once, completions add up over the n samples."""
    last: Dict[int, RequestOutput] = {}
    for o in outputs:
        last[o.index] = o
    outs = [last[i] for i in sorted(last)]
    prompt = outs[0].num_prompt_tokens if outs else 0
    completion = sum(o.num_output_tokens for o in outs)
    cached = outs[0].num_cached_tokens if outs else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _logprobs(fn, o: RequestOutput, decode: Optional[Decode], *args):
    return fn(o.token_ids, o.logprobs, o.top_logprobs, decode, *args) if o.logprobs is not None and decode else None
