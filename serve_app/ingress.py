"""The ingress deployment: OpenAI HTTP API -> tokens -> a replica stream -> SSE/JSON."""

import asyncio
import weakref
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import anthropic_messages as A
from .api import client_timeout
from .api import embeddings as E
from .api import protocol as P
from .api import responses as R
from .api import tools as T
from .config import AppArgs
from .models.catalog import Catalog, Target
from .models.residency import Residency
from .models.served_model import ServedModel
from .replica_outcomes import Overloaded, engine_error, model_loading, replica_error, replica_failed
from .sse import completion_events, whole, writer_events

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
    """Validates, picks the model, applies its chat template, tokenizes, and streams from
    one of its replicas."""

    def __init__(self, replicas: Dict[str, Dict[str, DeploymentHandle]], args: Dict[str, Any],
                 weights: Optional[Dict[str, Dict[str, float]]] = None, memory: Optional[Dict[str, float]] = None):
        self.args = AppArgs.model_validate(args)
        weights = weights or {}
        self.catalog = Catalog([ServedModel(m, self.args.for_model(m), replicas[m.name], weights.get(m.name))
                                for m in self.args.served_models()])
        longest = max(m.max_model_len for m in self.catalog.models.values())
        self.max_body_bytes = max(1 << 20, BODY_BYTES_PER_TOKEN * longest)
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 - constructed outside Serve (a test)
            app_name = None
        self.residency = Residency(self.catalog.models, app_name, memory or {})

    # --- endpoints -------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        resident = {}
        for m in self.catalog.models.values():
            if m.adapters and self.residency.loaded(m.name):
                try:
                    got = await asyncio.wait_for(asyncio.gather(*[h.remote() for h in m.resident_adapters.values()]), 2)
                    resident[m.name] = {a for names in got for a in names}
                except Exception:  # noqa: BLE001 - unknown for now
                    pass

        def loaded(m, adapter):
            up = self.residency.loaded(m.name)
            if adapter is None or not up:
                return up
            return adapter in resident[m.name] if m.name in resident else None
        return {"object": "list", "data": self.catalog.listing(loaded)}

    @api.get("/v1/stats")
    async def stats(self, request: Request):
        """Load and cache figures of the replicas (one call reaches one replica; of each
        group, when the app has several; of each model, when it serves several)."""
        self._auth(request)
        out = {}
        for m in self.catalog.models.values():
            if not self.residency.loaded(m.name):
                continue  # a call would load it
            names = list(m.stats_handles)
            stats = await asyncio.gather(*[m.stats_handles[g].remote() for g in names])
            one = {"replica": stats[0]}
            if m.groups is not None:
                one.update(groups=dict(zip(names, stats)), in_flight=dict(m.groups.inflight))
            if not out:
                out = dict(one)
            if len(self.catalog.models) > 1:
                out.setdefault("models", {})[m.name] = one
        return out

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._auth(request)
        body = P.parse_request(P.ChatCompletionRequest, await self._body(request))
        t = self.catalog.resolve(body.model)
        prompt_ids, parser, grammar, images = await self._chat_prompt(t.model, body)
        return await self._serve(t, body, prompt_ids, "chat", parser, grammar, images=images)

    @api.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API, served through the chat path."""
        t, body, rid, parser, first, stream = await self._mapped(request, A.MessagesRequest, "messages",
                                                                 P.random_id("msg", "_"))
        if body.stream:
            writer = A.StreamWriter(t.name, rid)
            return StreamingResponse(writer_events(first, stream, parser, writer, A), media_type="text/event-stream")
        message = A.message(await self._rest(first, stream), t.name, rid, whole(parser))
        return JSONResponse(message.model_dump(mode="json", exclude_unset=True))

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API, served through the chat path."""
        t, body, rid, parser, first, stream = await self._mapped(request, R.ResponsesRequest, "input", R.new_id("resp"))
        if body.stream:
            writer = R.StreamWriter(body, t.name, rid)
            return StreamingResponse(writer_events(first, stream, parser, writer, R), media_type="text/event-stream")
        response = R.response(body, await self._rest(first, stream), t.name, rid, whole(parser))
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        self._auth(request)
        body = P.parse_request(A.CountTokensRequest, await self._body(request))
        t = self.catalog.resolve(body.model)
        prompt_ids, _, _, _ = await self._chat_prompt(t.model, self._as_chat(body))
        return {"input_tokens": len(prompt_ids)}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request)
        body = P.parse_request(P.CompletionRequest, await self._body(request))
        t = self.catalog.resolve(body.model)
        m = t.model
        ids = m.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not ids:
            raise P.ProtocolError("prompt is empty", "prompt")
        if max(ids) >= m.vocab_size:
            raise P.ProtocolError(f"prompt token ids must be below {m.vocab_size}", "prompt")
        echo = None
        if body.echo:
            echo = P.Echo(body.prompt if isinstance(body.prompt, str) else m.tokenizer.decode(ids), ids)
        return await self._serve(t, body, ids, "completion", echo=echo)

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        self._auth(request)
        body = P.parse_request(E.EmbeddingRequest, await self._body(request))
        t = self.catalog.resolve(body.model)
        m = t.model
        prompts = [m.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in body.items()]
        for ids in prompts:
            if max(ids) >= m.vocab_size:
                raise P.ProtocolError(f"input token ids must be below {m.vocab_size}", "input")
            if len(ids) >= m.max_model_len:
                raise P.ProtocolError(f"an input is {len(ids)} tokens; the model's context is {m.max_model_len}",
                                      "input", "context_length_exceeded")
        # One replica call for all inputs: Serve routes an ingress request's concurrent
        # calls by one shared internal id, and leaves all but the first unrouted (hangs).
        payload = {"rid": P.random_id("embd"), "inputs": prompts, "pooling": m.pooling, "adapter": t.adapter}
        self.residency.begin(m.name)
        try:
            result = await self._on_replica(m, payload, m.page_hashes(prompts[0], t.adapter), self._embed_in)
        finally:
            self.residency.end(m.name)
        return E.response(result["vectors"], t.name, sum(map(len, prompts)), body.encoding_format)

    # --- the shared path -------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        self.residency.start()  # here: it needs the event loop, which __init__ does not run in
        key = self.args.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}" \
                and request.headers.get("x-api-key") != key:
            raise P.ProtocolError("invalid API key", code="invalid_api_key", status=401)

    async def _mapped(self, request: Request, cls, field: str, rid: str):
        """Start a request of an API that maps onto chat (Anthropic's, Responses): the
        parsed body, its id, its output parser, and its first output and stream."""
        self._auth(request)
        body = P.parse_request(cls, await self._body(request))
        t = self.catalog.resolve(body.model)
        chat = self._as_chat(body)
        prompt_ids, parser, grammar, images = await self._chat_prompt(t.model, chat)
        first, stream = await self._start(t, rid, prompt_ids, self._params(t.model, chat, prompt_ids, field, grammar),
                                          images)
        return t, body, rid, parser, first, stream

    @staticmethod
    def _as_chat(body) -> "P.ChatCompletionRequest":
        """An Anthropic or Responses request as the chat request it maps onto."""
        try:
            return body.to_chat()
        except ValidationError as e:
            raise P.ProtocolError.from_validation(e) from None
        except ValueError as e:  # an input item the chat path cannot take
            raise P.ProtocolError(str(e), "input") from None

    @staticmethod
    async def _chat_prompt(m: ServedModel, body: "P.ChatCompletionRequest"):
        """The prompt's token ids (chat template, tools rendered into it), the tools the
        output may call, the grammar that forces a call (tool_choice required/named), and
        its images (mlx_worker.vision ImageInputs; None without)."""
        choice = body.effective_tool_choice
        tools = body.tools if choice != "none" else None
        messages, kw, grammar = body.chat_messages(), dict(body.chat_template_kwargs or {}), None
        if body.reasoning_effort:
            kw["reasoning_effort"] = body.reasoning_effort
        if tools:
            if m.call_format.native:
                kw["tools"] = [t.model_dump(exclude_none=True) for t in tools]
            else:
                messages = T.with_tools(messages, tools)
            try:
                grammar = T.call_grammar(tools, choice, m.call_format)
            except ValueError as e:
                raise P.ProtocolError(str(e), "tool_choice")
        sources, images = body.image_urls(), None
        if sources and m.vision is None:
            raise P.ProtocolError(f"model {m.name!r} reads no images: send text, or use a vision model",
                                  "messages", "invalid_image")
        if sources:
            prompt_ids, images = await m.vision.prompt(messages, kw, sources)
        else:
            try:
                prompt_ids = list(m.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw))
            except Exception as e:  # noqa: BLE001 - templates raise anything
                raise P.ProtocolError(f"chat template failed: {e}", "messages")
        return prompt_ids, m.parser_factory(prompt_ids, tools), grammar, images

    def _params(self, m: ServedModel, body, prompt_ids: List[int], field: str, tool_grammar=None):
        n = len(prompt_ids)
        if n >= m.max_model_len:
            raise P.ProtocolError(f"prompt is {n} tokens; the model's context is {m.max_model_len}",
                                  field, "context_length_exceeded")
        return P.to_sampling_params(body, self.args.default_max_tokens, m.max_model_len, n, tool_grammar)

    async def _start(self, t: Target, rid: str, prompt_ids: List[int], params, images=None):
        """Send a request to a replica of its model: its first output and the rest of the stream."""
        hashes = t.model.page_hashes(prompt_ids, t.adapter, images)
        payload = {"rid": rid, "prompt_ids": prompt_ids, "params": params.model_dump(), "page_hashes": hashes,
                   "adapter": t.adapter, "images": images.model_dump() if images is not None else None}
        name = t.model.name
        self.residency.begin(name)  # in flight until the response is done with its stream
        try:
            first, stream = await self._on_replica(t.model, payload, hashes, self._start_in)
        except BaseException:
            self.residency.end(name)
            raise
        weakref.finalize(stream, self.residency.end, name)
        return first, stream

    async def _on_replica(self, m: ServedModel, payload: dict, hashes: List[int], call):
        """`call(m, group, payload, hashes)` on the best replica of model `m` that takes the request: a
        replica that refuses it as overloaded is avoided in the next try (the router
        ranks it last), up to MAX_REPLICA_TRIES in a group, then the next group (when
        the app has several) is tried; the last refusal is the answer (429). Each try
        carries the time its client has left then: a refusal may come late (a request
        taken, then withdrawn), and a retry that believed it had the whole timeout would
        be taken for a client about to leave."""
        groups = m.groups.ranked(hashes) if m.groups else list(m.generate)
        refusal = None
        for group in groups:
            avoid = []
            for _ in range(MAX_REPLICA_TRIES):
                try:
                    try_payload = {**payload, "avoid_engines": avoid, "timeout_s": client_timeout.seconds_left()}
                    return await call(m, group, try_payload, hashes)
                except BackPressureError:
                    refusal = refusal or Overloaded("the server is overloaded; retry later", self.args.retry_after_s)
                    break
                except Overloaded as e:  # the replica predicts it cannot finish in time
                    refusal = e if refusal is None or e.retry_after < refusal.retry_after else refusal
                    if e.engine_id is None or e.engine_id in avoid:
                        break  # no replica left that has not refused it
                    avoid.append(e.engine_id)
        raise refusal

    async def _embed_in(self, m: ServedModel, group: str, payload: dict, hashes: List[int]) -> dict:
        if m.groups:
            m.groups.started(group, hashes)
        try:
            result = await self._when_loaded(m, m.embed[group].remote(payload))
        except (BackPressureError, P.ProtocolError):
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed
            raise replica_failed(e)
        finally:
            if m.groups:
                m.groups.finished(group)
        if "error" in result:
            raise replica_error(result)
        return result

    async def _start_in(self, m: ServedModel, group: str, payload: dict, hashes: List[int]):
        stream = m.generate[group].remote(payload)
        if m.groups:  # in flight until the response is done with its stream
            m.groups.started(group, hashes)
            weakref.finalize(stream, m.groups.finished, group)
        try:
            first = await self._when_loaded(m, stream.__anext__())
        except P.ProtocolError:
            stream.cancel()
            raise
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

    async def _when_loaded(self, m: ServedModel, first):
        """Await a replica's first answer; for a model not loaded, within the client's
        time left, else 503 + Retry-After (the model goes on loading for the next try)."""
        if self.residency.loaded(m.name) is not False:
            return await first
        try:
            return await asyncio.wait_for(first, client_timeout.seconds_left())
        except asyncio.TimeoutError:
            raise model_loading(m.name) from None

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
                                  f"(the longest model context is {self.max_body_bytes // BODY_BYTES_PER_TOKEN} "
                                  f"tokens)",
                                  code="request_too_large", status=413)
        return raw

    async def _serve(self, t: Target, body, prompt_ids: List[int], kind: str, parser=None, tool_grammar=None,
                     echo=None, images=None):
        params = self._params(t.model, body, prompt_ids, "messages" if kind == "chat" else "prompt", tool_grammar)
        rid = P.random_id("chatcmpl" if kind == "chat" else "cmpl")
        first, stream = await self._start(t, rid, prompt_ids, params, images)
        tokenizer = t.model.tokenizer
        decode = (lambda tok: tokenizer.decode([tok])) if params.logprobs else None
        if body.stream:
            events = completion_events(t.name, kind, first, stream, rid, decode, body.include_usage, parser, echo)
            return StreamingResponse(events, media_type="text/event-stream")
        outs = await self._rest(first, stream)
        if kind == "chat":
            response = P.chat_completion(outs, t.name, decode, id=rid, parse=whole(parser))
        else:
            response = P.completion(outs, t.name, decode, id=rid, echo=echo)
        return JSONResponse(response.model_dump(mode="json"))


Ingress = serve.deployment(serve.ingress(api)(Ingress), name="Ingress")
