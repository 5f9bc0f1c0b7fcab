"""Streamed answers: a replica's outputs as server-sent events, in OpenAI's chunk shape
(chat and completions) or through an API's event writer (Anthropic's, Responses')."""

import json
import time
from typing import AsyncIterator, Dict, Optional

from .api import protocol as P
from .api.output_parser import OutputParser, Parsed
from .replica_outcomes import engine_error, replica_failed


async def completion_events(model_name, kind, first, stream, rid, decode, include_usage, parser=None,
                            echo=None) -> AsyncIterator[str]:
    """A chat or completion request's outputs as OpenAI's SSE chunks, [DONE] last."""
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
                chunk = P.chat_chunk(out, rid, created, model_name, decode, first=out.index not in started,
                                     parsed=piece(p, out), called=bool(p and p.num_calls))
                started.add(out.index)
            else:
                fresh = out.index not in offsets
                chunk = P.completion_chunk(out, rid, created, model_name, decode, offsets.get(out.index, 0),
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
            tail = cls(id=rid, created=created, model=model_name, choices=[], usage=P.usage(outs))
            yield f"data: {tail.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()  # no-op when finished; aborts the engine request on disconnect

async def pieces(first, stream, parser) -> AsyncIterator[tuple]:
    """(output, what it adds) for each streamed output of a one-sample request; a
    ProtocolError in place of the piece when the engine or the replica fails it."""
    parser = parser() if parser else None
    out = first
    while True:
        if out.finish_reason == "error":
            yield out, engine_error(out)
            return
        yield out, piece(parser, out)
        if out.finished:
            return
        try:
            out = await stream.__anext__()
        except StopAsyncIteration:
            return
        except Exception as e:  # noqa: BLE001 - the replica died mid-stream
            yield None, replica_failed(e)
            return

async def writer_events(first, stream, parser, writer, module) -> AsyncIterator[str]:
    """One sample's stream through an API's event writer (`module`: api.anthropic_messages or
    api.responses: its StreamWriter's events, `sse` and `error_event`)."""
    try:
        for event in writer.start(first):
            yield module.sse(event)
        async for out, piece in pieces(first, stream, parser):
            if isinstance(piece, P.ProtocolError):
                yield module.error_event(piece.status, piece.message)
                return
            for event in writer.events(piece) + (list(writer.finish(out)) if out.finished else []):
                yield module.sse(event)
    finally:
        stream.cancel()


def whole(parser):
    """A whole sample's text -> Parsed, with a fresh parser (None: all content)."""
    return (lambda out: parser().whole(out.text, out.finish_reason)) if parser else None


def piece(parser: Optional[OutputParser], out) -> Parsed:
    """What one streamed output adds (all of the rest when it is the last)."""
    if parser is None:
        return Parsed(out.text)
    return parser.feed(out.text) + (parser.finish(out.finish_reason) if out.finished else Parsed())
