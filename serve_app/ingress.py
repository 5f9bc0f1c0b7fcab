"""The ingress deployment: OpenAI HTTP API -> tokens -> a replica stream -> SSE/JSON."""

import asyncio
import json
import time
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_worker.memory.paging import PAGE_SIZE, page_hashes

from .api import anthropic_messages as A
from .api import client_timeout
from .api import embeddings as E
from .api import protocol as P
from .api import responses as R
from .api import tools as T
from .api.harmony import HarmonyParser, is_harmony
from .api.output_parser import OutputParser, Parsed, starts_in_reasoning, think_format
from .config import AppArgs
from .model_files import context_length, download_tokenizer, served_name
from .replica_outcomes import Overloaded, engine_error, replica_error, replica_failed
from .routing.replica_groups import GroupPicker

api = FastAPI(title="macfarm", description="OpenAI-compatible LLM serving on a Mac farm")

# A body is refused (413) past this many bytes per token of context (at least 1 MiB):
# tokenizing a multi-MB prompt that cannot fit anyway blocks the ingress for seconds.
BODY_BYTES_PER_TOKEN = 64
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")  # errors there take Anthropic's shape
MAX_REPLICA_TRIES = 4  # replicas of one group tried in turn when they refuse a request as overloaded


def _error(request: Request, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
           headers=None):
    """An error in the shape of the API the request went to."""
    if request.url.path.rstrip("/").endswith(ANTHROPIC_ROUTES):  # under any route prefix
        return JSONResponse(A.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(P.error_body(status, message, param, code), status_code=status, headers=headers)


@api.exception_handler(P.ProtocolError)
async def _protocol_error(request: Request, e: "P.ProtocolError"):
    return _error(request, e.status, e.message, e.param, e.code, getattr(e, "headers", None))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
    return _error(request, 400, msg, loc or None, "invalid_request")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    return _error(request, e.status_code, str(e.detail))


class Ingress:
    """Validates, applies the chat template, tokenizes, and streams from a replica."""

    def __init__(self, replicas: Dict[str, DeploymentHandle], args: Dict[str, Any],
                 weights: Optional[Dict[str, float]] = None):
        from mlx_lm.utils import load_tokenizer

        from mlx_worker.models.gguf import resolve_model

        self.args = AppArgs.model_validate(args)
        path = resolve_model(self.args.model)
        local = Path(path) if Path(path).exists() else download_tokenizer(path)  # tokenizer + config only
        self.tokenizer = load_tokenizer(local)
        self.model_name = self.args.model_name or served_name(self.args.model)
        self.max_model_len = context_length(local)
        self.vocab_size = len(self.tokenizer._tokenizer)
        self.page_size = int(self.args.engine.get("page_size", PAGE_SIZE))
        self.max_body_bytes = max(1 << 20, BODY_BYTES_PER_TOKEN * self.max_model_len)
        # One deployment per replica group (app.py): several when replicas differ in size.
        self.generate = {g: h.options(stream=True, method_name="generate") for g, h in replicas.items()}
        self.embed = {g: h.options(method_name="embed") for g, h in replicas.items()}
        self.stats_handles = {g: h.options(method_name="stats") for g, h in replicas.items()}
        self.groups = GroupPicker(weights or {g: 1.0 for g in replicas}) if len(replicas) > 1 else None
        self.harmony = is_harmony(self.tokenizer)  # gpt-oss
        self.call_format = T.HARMONY_CALLS if self.harmony else T.call_format(self.tokenizer)
        self.think = think_format(self.tokenizer)
        self.pooling = E.pooling(local)
        self.created = int(time.time())

    # --- endpoints -------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "macfarm"}]}

    @api.get("/v1/stats")
    async def stats(self, request: Request):
        """Load and cache figures of the replicas (one call reaches one replica; of each
        group, when the app has several)."""
        self._auth(request)
        names = list(self.stats_handles)
        stats = await asyncio.gather(*[self.stats_handles[g].remote() for g in names])
        if self.groups is None:
            return {"replica": stats[0]}
        return {"replica": stats[0], "groups": dict(zip(names, stats)), "in_flight": dict(self.groups.inflight)}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._auth(request)
        body = P.parse_request(P.ChatCompletionRequest, await self._body(request))
        self._check_model(body.model)
        prompt_ids, parser, grammar = self._chat_prompt(body)
        return await self._serve(body, prompt_ids, "chat", parser, grammar)

    @api.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API, served through the chat path."""
        body, rid, parser, first, stream = await self._mapped(request, A.MessagesRequest, "messages", P.random_id("msg", "_"))
        if body.stream:
            writer = A.StreamWriter(self.model_name, rid)
            return StreamingResponse(self._writer_sse(first, stream, parser, writer, A), media_type="text/event-stream")
        message = A.message(await self._rest(first, stream), self.model_name, rid, _whole(parser))
        return JSONResponse(message.model_dump(mode="json", exclude_unset=True))

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API, served through the chat path."""
        body, rid, parser, first, stream = await self._mapped(request, R.ResponsesRequest, "input", R.new_id("resp"))
        if body.stream:
            writer = R.StreamWriter(body, self.model_name, rid)
            return StreamingResponse(self._writer_sse(first, stream, parser, writer, R), media_type="text/event-stream")
        response = R.response(body, await self._rest(first, stream), self.model_name, rid, _whole(parser))
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        self._auth(request)
        body = P.parse_request(A.CountTokensRequest, await self._body(request))
        self._check_model(body.model)
        prompt_ids, _, _ = self._chat_prompt(self._as_chat(body))
        return {"input_tokens": len(prompt_ids)}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request)
        body = P.parse_request(P.CompletionRequest, await self._body(request))
        self._check_model(body.model)
        ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not ids:
            raise P.ProtocolError("prompt is empty", "prompt")
        if max(ids) >= self.vocab_size:
            raise P.ProtocolError(f"prompt token ids must be below {self.vocab_size}", "prompt")
        echo = None
        if body.echo:
            echo = P.Echo(body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(ids), ids)
        return await self._serve(body, ids, "completion", echo=echo)

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        self._auth(request)
        body = P.parse_request(E.EmbeddingRequest, await self._body(request))
        self._check_model(body.model)
        prompts = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in body.items()]
        for ids in prompts:
            if max(ids) >= self.vocab_size:
                raise P.ProtocolError(f"input token ids must be below {self.vocab_size}", "input")
            if len(ids) >= self.max_model_len:
                raise P.ProtocolError(f"an input is {len(ids)} tokens; the model's context is {self.max_model_len}",
                                      "input", "context_length_exceeded")
        # One replica call for all inputs: Serve routes an ingress request's concurrent
        # calls by one shared internal id, and leaves all but the first unrouted (hangs).
        payload = {"rid": P.random_id("embd"), "inputs": prompts, "pooling": self.pooling}
        result = await self._on_replica(payload, page_hashes(prompts[0], self.page_size), self._embed_in)
        return E.response(result["vectors"], self.model_name, sum(map(len, prompts)), body.encoding_format)

    # --- the shared path -------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.args.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}" \
                and request.headers.get("x-api-key") != key:
            raise P.ProtocolError("invalid API key", code="invalid_api_key", status=401)

    async def _mapped(self, request: Request, cls, field: str, rid: str):
        """Start a request of an API that maps onto chat (Anthropic's, Responses): the
        parsed body, its id, its output parser, and its first output and stream."""
        self._auth(request)
        body = P.parse_request(cls, await self._body(request))
        self._check_model(body.model)
        chat = self._as_chat(body)
        prompt_ids, parser, grammar = self._chat_prompt(chat)
        first, stream = await self._start(rid, prompt_ids, self._params(chat, prompt_ids, field, grammar))
        return body, rid, parser, first, stream

    @staticmethod
    def _as_chat(body) -> "P.ChatCompletionRequest":
        """An Anthropic or Responses request as the chat request it maps onto."""
        try:
            return body.to_chat()
        except ValidationError as e:
            raise P.ProtocolError.from_validation(e) from None
        except ValueError as e:  # an input item the chat path cannot take
            raise P.ProtocolError(str(e), "input") from None

    def _chat_prompt(self, body: "P.ChatCompletionRequest"):
        """The prompt's token ids (chat template, tools rendered into it), the tools the
        output may call, and the grammar that forces a call (tool_choice required/named)."""
        choice = body.effective_tool_choice
        tools = body.tools if choice != "none" else None
        messages, kw, grammar = body.chat_messages(), dict(body.chat_template_kwargs or {}), None
        if body.reasoning_effort:
            kw["reasoning_effort"] = body.reasoning_effort
        if tools:
            if self.call_format.native:
                kw["tools"] = [t.model_dump(exclude_none=True) for t in tools]
            else:
                messages = T.with_tools(messages, tools)
            try:
                grammar = T.call_grammar(tools, choice, self.call_format)
            except ValueError as e:
                raise P.ProtocolError(str(e), "tool_choice")
        try:
            prompt_ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw))
        except Exception as e:  # noqa: BLE001 - templates raise anything
            raise P.ProtocolError(f"chat template failed: {e}", "messages")
        return prompt_ids, self._parser_factory(prompt_ids, tools), grammar

    def _parser_factory(self, prompt_ids: List[int], tools):
        """Makes a sample's OutputParser (reasoning, content, tool calls); None when the
        model has no thinking markers and there are no tools: the text is all content."""
        if self.harmony:
            return HarmonyParser
        if not (self.think or tools):
            return None
        in_reasoning = starts_in_reasoning(self.tokenizer, prompt_ids)
        return lambda: OutputParser(self.think, self.call_format, tools, in_reasoning)

    def _params(self, body, prompt_ids: List[int], field: str, tool_grammar=None):
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise P.ProtocolError(f"prompt is {n} tokens; the model's context is {self.max_model_len}",
                                  field, "context_length_exceeded")
        return P.to_sampling_params(body, self.args.default_max_tokens, self.max_model_len, n, tool_grammar)

    async def _start(self, rid: str, prompt_ids: List[int], params):
        """Send a request to a replica: its first output and the rest of the stream."""
        hashes = page_hashes(prompt_ids, self.page_size)
        payload = {"rid": rid, "prompt_ids": prompt_ids, "params": params.model_dump(), "page_hashes": hashes}
        return await self._on_replica(payload, hashes, self._start_in)

    async def _on_replica(self, payload: dict, hashes: List[int], call):
        """`call(group, payload, hashes)` on the best replica that takes the request: a
        replica that refuses it as overloaded is avoided in the next try (the router
        ranks it last), up to MAX_REPLICA_TRIES in a group, then the next group (when
        the app has several) is tried; the last refusal is the answer (429). Each try
        carries the time its client has left then: a refusal may come late (a request
        taken, then withdrawn), and a retry that believed it had the whole timeout would
        be taken for a client about to leave."""
        groups = self.groups.ranked(hashes) if self.groups else list(self.generate)
        refusal = None
        for group in groups:
            avoid = []
            for _ in range(MAX_REPLICA_TRIES):
                try:
                    try_payload = {**payload, "avoid_engines": avoid, "timeout_s": client_timeout.seconds_left()}
                    return await call(group, try_payload, hashes)
                except BackPressureError:
                    refusal = refusal or Overloaded("the server is overloaded; retry later", self.args.retry_after_s)
                    break
                except Overloaded as e:  # the replica predicts it cannot finish in time
                    refusal = e if refusal is None or e.retry_after < refusal.retry_after else refusal
                    if e.engine_id is None or e.engine_id in avoid:
                        break  # no replica left that has not refused it
                    avoid.append(e.engine_id)
        raise refusal

    async def _embed_in(self, group: str, payload: dict, hashes: List[int]) -> dict:
        if self.groups:
            self.groups.started(group, hashes)
        try:
            result = await self.embed[group].remote(payload)
        except BackPressureError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed
            raise replica_failed(e)
        finally:
            if self.groups:
                self.groups.finished(group)
        if "error" in result:
            raise replica_error(result)
        return result

    async def _start_in(self, group: str, payload: dict, hashes: List[int]):
        stream = self.generate[group].remote(payload)
        if self.groups:  # in flight until the response is done with its stream
            self.groups.started(group, hashes)
            weakref.finalize(stream, self.groups.finished, group)
        try:
            first = await stream.__anext__()
        except BackPressureError:
            raise
        except StopAsyncIteration:
            raise P.ProtocolError("the replica ended the stream without output", status=500)
        except Exception as e:  # noqa: BLE001 - the replica died or failed: no output yet
            raise replica_failed(e)
        if isinstance(first, dict):
            stream.cancel()
            raise replica_error(first)
        if first.finish_reason == "error":
            raise engine_error(first)
        return first, stream

    @staticmethod
    async def _rest(first, stream) -> list:
        """All outputs of a request that is not streamed to the client."""
        outs = [first]
        try:
            async for out in stream:
                outs.append(out)
        except Exception as e:  # noqa: BLE001 - the replica died mid-request
            raise replica_failed(e)
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise engine_error(failed[0])
        return outs

    async def _body(self, request: Request) -> bytes:
        client_timeout.start(request.headers)
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise P.ProtocolError(f"the request body is {len(raw)} bytes; at most {self.max_body_bytes} are accepted "
                                  f"(the model's context is {self.max_model_len} tokens)",
                                  code="request_too_large", status=413)
        return raw

    def _check_model(self, model: Optional[str]) -> None:
        if model and model not in (self.model_name, self.args.model):
            raise P.ProtocolError(f"model {model!r} does not exist; this server serves {self.model_name!r}",
                                  "model", "model_not_found", status=404)

    async def _serve(self, body, prompt_ids: List[int], kind: str, parser=None, tool_grammar=None, echo=None):
        params = self._params(body, prompt_ids, "messages" if kind == "chat" else "prompt", tool_grammar)
        rid = P.random_id("chatcmpl" if kind == "chat" else "cmpl")
        first, stream = await self._start(rid, prompt_ids, params)
        decode = self._decode_token if params.logprobs else None
        if body.stream:
            return StreamingResponse(self._sse(kind, first, stream, rid, decode, body.include_usage, parser, echo),
                                     media_type="text/event-stream")
        outs = await self._rest(first, stream)
        if kind == "chat":
            response = P.chat_completion(outs, self.model_name, decode, id=rid, parse=_whole(parser))
        else:
            response = P.completion(outs, self.model_name, decode, id=rid, echo=echo)
        return JSONResponse(response.model_dump(mode="json"))

    async def _sse(self, kind, first, stream, rid, decode, include_usage, parser=None, echo=None) -> AsyncIterator[str]:
        created, outs, started, offsets = int(time.time()), [], set(), {}
        parsers: Dict[int, OutputParser] = {}
        try:
            out = first
            while True:
                if out.finish_reason == "error":  # the engine failed this request mid-stream: say so, end
                    yield f"data: {json.dumps(engine_error(out).body())}\n\n"
                    return
                outs.append(out)
                if kind == "chat":
                    p = parsers.setdefault(out.index, parser()) if parser else None
                    chunk = P.chat_chunk(out, rid, created, self.model_name, decode, first=out.index not in started,
                                         parsed=_piece(p, out), called=bool(p and p.num_calls))
                    started.add(out.index)
                else:
                    fresh = out.index not in offsets
                    chunk = P.completion_chunk(out, rid, created, self.model_name, decode, offsets.get(out.index, 0),
                                               echo if fresh else None)
                    offsets[out.index] = offsets.get(out.index, 0) + len(chunk.choices[0].text)
                yield f"data: {chunk.model_dump_json()}\n\n"
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001 - the replica died mid-stream: say so, end
                    yield f"data: {json.dumps(replica_failed(e).body())}\n\n"
                    return  # no usage, no [DONE]: the stream did not complete
            if include_usage:
                cls = P.ChatCompletionChunk if kind == "chat" else P.Completion
                tail = cls(id=rid, created=created, model=self.model_name, choices=[], usage=P.usage(outs))
                yield f"data: {tail.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # no-op when finished; aborts the engine request on disconnect

    async def _pieces(self, first, stream, parser) -> AsyncIterator[tuple]:
        """(output, what it adds) for each streamed output of a one-sample request; a
        ProtocolError in place of the piece when the engine or the replica fails it."""
        parser = parser() if parser else None
        out = first
        while True:
            if out.finish_reason == "error":
                yield out, engine_error(out)
                return
            yield out, _piece(parser, out)
            if out.finished:
                return
            try:
                out = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                yield None, replica_failed(e)
                return

    async def _writer_sse(self, first, stream, parser, writer, module) -> AsyncIterator[str]:
        """One sample's stream through an API's event writer (`module`: api.anthropic_messages or
        api.responses: its StreamWriter's events, `sse` and `error_event`)."""
        try:
            for event in writer.start(first):
                yield module.sse(event)
            async for out, piece in self._pieces(first, stream, parser):
                if isinstance(piece, P.ProtocolError):
                    yield module.error_event(piece.status, piece.message)
                    return
                for event in writer.events(piece) + (list(writer.finish(out)) if out.finished else []):
                    yield module.sse(event)
        finally:
            stream.cancel()

    def _decode_token(self, tok: int) -> str:
        return self.tokenizer.decode([tok])


def _whole(parser):
    """A whole sample's text -> Parsed, with a fresh parser (None: all content)."""
    return (lambda out: parser().whole(out.text, out.finish_reason)) if parser else None


def _piece(parser: Optional[OutputParser], out) -> Parsed:
    """What one streamed output adds (all of the rest when it is the last)."""
    if parser is None:
        return Parsed(out.text)
    return parser.feed(out.text) + (parser.finish(out.finish_reason) if out.finished else Parsed())


Ingress = serve.deployment(serve.ingress(api)(Ingress), name="Ingress")
