"""An OpenAI-compatible server for a looped model (``tools/serve.py``).

Endpoints:

- ``POST /v1/completions`` (the legacy completions API) and ``POST /v1/chat/completions``
  (``messages`` with system / user / assistant roles, put into a prompt by the chat template of
  megaloop/inference/chat.py), both with ``"stream": true`` (server-sent events in OpenAI's
  chunk format: ``data: {...}`` lines, ``choices[].text`` / ``choices[].delta``, the
  ``finish_reason`` in each choice's last chunk, ``stream_options.include_usage`` for a usage
  chunk, then ``data: [DONE]``); the fields each takes: megaloop/inference/openai_api.py;
- ``GET /v1/models``, ``GET /v1/models/{id}`` (404 for another id), ``GET /health`` (200 while
  the model serves);
- vLLM's tokenizer endpoints, ``GET /tokenizer_info``, ``POST /tokenize`` and
  ``POST /detokenize`` (lm-evaluation-harness's ``local-completions`` tokenizes through them).

Generation fields: ``prompt`` (completions: a text, a list of texts, a list of token ids or a list
of lists of ids), ``max_tokens`` (completions default 16), ``temperature`` (default 1; 0 =
greedy), ``top_p``, ``top_k`` and ``seed`` (extensions; no seed: a fresh one per request; with one,
the same request gives the same choices), ``n`` (choices per prompt, drawn in one batch),
``stop`` (a string or a list: a row stops as soon as its text holds one; the text returned ends
before it), ``logprobs`` (completions, N: the top-N log-probs of every returned token, always
with the chosen token's; chat: ``logprobs`` true and ``top_logprobs`` N, in the chat format; not
with ``stream``) and ``echo`` (completions: the prompt is returned
too; with ``logprobs`` its tokens get teacher-forced log-probs, the first ``null`` as OpenAI's).
``echo`` + ``logprobs`` + ``max_tokens`` 0 or 1 is what lm-evaluation-harness's
``local-completions`` model sends to score log-likelihoods. ``usage`` counts every prompt once
and every token generated (a stop string's and the end-of-document token included). How
request text is tokenized (special tokens) and where log-probs come from:
megaloop/inference/jobs.py. Limits per request (prompts, ``n``, tokens): ``RequestLimits``, flags
of tools/serve.py; a request beyond one gets HTTP 400 naming the limit and its flag.

Threads. The model is not re-entrant, and its process state is per thread (the CUDA current
device; on CPU the shim's device-rewriting mode). So the model runs on the thread that loaded it
(the main thread), which decodes every request's rows together with the batching engine
(megaloop/inference/batcher.py: new requests join between steps); uvicorn's event loop runs in
a second thread, where validation happens; tokenizing a request and building its response run
in that loop's worker threads (they take time in proportion to the request's size). A body over
``--max-request-bytes`` gets HTTP 413 before it is read. A fault that belongs to one row (a
value the engine refuses, a draw that fails) fails only its request (HTTP 500 with the message,
a stream's error event); the other rows decode on (megaloop/inference/lockstep.py). A client that leaves
(its connection closes) has its rows cancelled, freed at the next engine step; a queued request
never starts. ``GET /stats`` (megaloop's own) reports the engine's counters after its last step.

Access: with ``--api-key`` every request but ``GET /health`` must carry the header
``Authorization: Bearer <key>`` (HTTP 401 otherwise, an OpenAI-style error body); without it,
whoever reaches the port may use the model (tools/serve.py warns when that is beyond loopback).

Tensor parallelism (a torchrun launch): rank 0 serves HTTP and every rank steps the same batch
(megaloop/inference/lockstep.py); the other ranks open no port.
"""

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Optional

from megaloop.inference.jobs import Job, ModelService
from megaloop.inference.openai_api import (ChatCompletionRequest, CompletionRequest,
                                           DetokenizeRequest, RequestError, TokenizeRequest)

log = logging.getLogger("megaloop.serve")


def _error(status: int, message: str, param: Optional[str] = None):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})


def _validation_message(errors) -> str:
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', '')}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "finite_number":
            return f"{loc} {e.get('input')}: must be a finite number"
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    # A union (prompt) reports one error per alternative: keep the first few.
    return "; ".join(dict.fromkeys(parts[:4])) or "invalid request"


def _note(job: Job) -> str:
    """The request's log note: its size and what it cost."""
    u = job.usage()
    note = (f"prompts={len(job.prompts)} n={job.n} prompt_tokens={u['prompt_tokens']} "
            f"completion_tokens={u['completion_tokens']}")
    if job.depths:
        note += f" mean_depth={sum(job.depths) / len(job.depths):.2f}"
    return note


class _LogRequests:
    """One log line per request, written when its response is complete (a stream's when it
    ends), with the note its handler left in ``request.state.note``. Plain ASGI: Starlette's
    BaseHTTPMiddleware would hide the client's disconnect from ``request.is_disconnected()``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        state = scope.setdefault("state", {})
        state["note"] = ""

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            raise
        note = state.get("note", "")
        log.info("%s %s %d %.3fs%s", scope["method"], scope["path"], status[0],
                 time.perf_counter() - start, f" {note}" if note else "")


class _LimitBody:
    """Refuses a request body of more than ``limit`` bytes with HTTP 413 before reading it: at
    once by its Content-Length, and a body sent in chunks (no length) as soon as the bytes
    received pass the limit. Reading, parsing and tokenizing a body of tens of megabytes would
    otherwise hold the event loop (every stream, /health) for seconds."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self, size: str) -> str:
        return (f"the request body has {size} bytes; this server takes at most {self.limit} "
                f"(--max-request-bytes): send less, or start the server with a larger "
                f"--max-request-bytes")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            body = json.dumps({"error": {"message": self.message(length.decode()),
                                         "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            # The body stays unread: the connection cannot carry another request.
            await send({"type": "http.response.start", "status": 413, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        received = [0]

        async def counted():
            from starlette.exceptions import HTTPException

            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.limit:  # (FastAPI passes an HTTPException on as it is)
                    raise HTTPException(413, self.message(f"more than {self.limit}"))
            return message

        await self.app(scope, receive if length else counted, send)


class _RequireKey:
    """``--api-key``: a request without the header ``Authorization: Bearer <key>`` gets HTTP 401
    with an OpenAI-style error body (as OpenAI's API and vLLM's ``--api-key`` answer), before
    its body is read. ``GET /health`` stays open: a load balancer's or orchestrator's liveness
    probe sends no credentials, and it tells nothing but that the model serves. The key is
    compared in constant time (a timing difference would tell a guesser how much was right)."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        # (HTTP drops a header value's surrounding spaces: a key's own could never be sent)
        self.app, self.key = app, key.strip().encode()

    def refusal(self, headers: dict) -> Optional[str]:
        import hmac

        given = headers.get(b"authorization")
        if given is None:
            return ("no API key: this server takes requests with the header Authorization: "
                    "Bearer <key> (the key it was started with, --api-key)")
        scheme, _, key = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.key):
            return "incorrect API key: send the header Authorization: Bearer <key>"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        message = self.refusal(dict(scope["headers"]))
        if message is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _Stream:
    """A job's server-sent events: the chunks of OpenAI's streaming format, as the model thread
    hands over each row's text; the job is cancelled when the client leaves."""

    def __init__(self, service: ModelService, job: Job, request, chat: bool, include_usage: bool,
                 user_note: str):
        self.service, self.job, self.request, self.chat = service, job, request, chat
        self.include_usage, self.user_note = include_usage, user_note
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _chunk(self, choices: list, **extra) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else
                "text_completion", "created": self.created, "model": self.service.model_name,
                "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _choice(self, i: int, text: Optional[str], finish: Optional[str], role: bool = False):
        if not self.chat:
            return {"text": text or "", "index": i, "logprobs": None, "finish_reason": finish}
        delta = {} if text is None else {"content": text}
        if role:
            delta = {"role": "assistant", **delta}
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def events(self):
        loop, job = asyncio.get_running_loop(), self.job
        events: asyncio.Queue = asyncio.Queue()
        job.emit = lambda *e: loop.call_soon_threadsafe(events.put_nowait, e)
        future = self.service.submit(job)
        # After the job's last emit (the same thread, in order): the end of its events.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        outcome = "cancelled: the client left"
        try:
            for i, p in enumerate(job.rows):  # first chunks: the role, or the echoed prompt
                if self.chat or job.echo:
                    text = "" if self.chat else self.service.tokenizer.detokenize(p)
                    yield self._chunk([self._choice(i, text, None, role=True)])
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    if await self.request.is_disconnected():
                        return
                    continue
                if event is None:
                    break
                i, text, finish = event
                if text or finish is None:
                    yield self._chunk([self._choice(i, text, None)])
                if finish is not None:
                    yield self._chunk([self._choice(i, None, finish)])
            if future.cancelled():
                return
            if future.exception() is not None:
                exc = future.exception()
                log.error("streamed generation failed: %s: %s", type(exc).__name__, exc)
                outcome = f"error: {exc}"
                yield "data: " + json.dumps({"error": {
                    "message": f"generation failed: {type(exc).__name__}: {exc}",
                    "type": "server_error", "param": None, "code": None}}) + "\n\n"
            elif self.include_usage:
                yield self._chunk([], usage=job.usage())
            if future.exception() is None:
                outcome = "done"
            yield "data: [DONE]\n\n"
        finally:
            if not future.done():
                job.cancelled.set()
                future.cancel()  # not started yet: it never runs
            self.request.state.note = f"stream {outcome}; {_note(job)}{self.user_note}"


async def _generate(service: ModelService, job: Job, request):
    """Run ``job`` on the model thread; cancel it if the client leaves first (None then)."""
    future = service.submit(job)
    waiting = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.1)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                return None
    finally:
        if not future.done():
            job.cancelled.set()
            waiting.cancel()  # and the job's future: a queued job never starts


def create_app(service: ModelService, api_key: Optional[str] = None):
    """The FastAPI application serving ``service``; with ``api_key``, to requests that carry
    it (``_RequireKey``)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="megaloop", docs_url=None, redoc_url=None)

    app.add_middleware(_LimitBody, limit=service.limits.max_request_bytes)
    if api_key is not None:  # (outside the size limit: a client without the key learns no more)
        app.add_middleware(_RequireKey, key=api_key)
    app.add_middleware(_LogRequests)  # (the outer one: it logs the 401s and 413s too)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message = _validation_message(exc.errors())
        request.state.note = message
        return _error(400, message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created,
                "owned_by": "megaloop", "max_model_len": service.max_length}

    @app.get("/health")
    async def health():
        if not service.serving:
            return _error(503, "the model thread is not taking requests")
        return {"status": "ok", "model": service.model_name}

    # megaloop's own: the batching engine's counters after its last step (forwards, rows per
    # decode forward, KV blocks in use...), for benchmarks and monitoring.
    @app.get("/stats")
    async def stats():
        return service.stats

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != service.model_name:
            return _error(404, f"model {model_id!r} is not served here; this server serves "
                               f"{service.model_name!r}", "model")
        return model_card()

    # vLLM's tokenizer endpoints: lm-eval's local-completions finds them and tokenizes with the
    # served model's own tokenizer (no Hugging Face tokenizer needed on the client).
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        specials = service.special_tokens()
        return {"tokenizer_class": type(service.tokenizer).__name__,
                "eos_token": specials["eos_token"][0],
                "bos_token": specials["bos_token"][0] if "bos_token" in specials else None,
                "pad_token": None, "model_max_length": service.max_length,
                "vocab_size": service.vocab_size}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        try:
            service.check_model(req.model)
            tokens = await off_loop(service.tokenize, req.prompt)
        except RequestError as exc:
            return _error(exc.status, exc.message, exc.param)
        except Exception as exc:  # e.g. the null tokenizer reads only integers
            return _error(400, f"the tokenizer cannot read the prompt: {exc}", "prompt")
        if req.add_special_tokens and service.tokenizer.bos is not None:
            tokens = [service.tokenizer.bos] + tokens
        return {"tokens": tokens, "count": len(tokens), "max_model_len": service.max_length}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        bad = [i for i in req.tokens if not 0 <= i < service.vocab_size]
        if req.model is not None and req.model != service.model_name:
            return _error(404, f"model {req.model!r} is not served here", "model")
        if bad:
            return _error(400, f"token id {bad[0]} is outside the vocabulary (size "
                               f"{service.vocab_size})", "tokens")
        return {"prompt": service.tokenizer.detokenize(req.tokens)}

    async def off_loop(fn, *args):
        """``fn(*args)`` in a worker thread: tokenizing a prompt (or detokenizing an answer's
        log-probs) takes time in proportion to its size, during which the event loop must go on
        serving the streams and /health."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def answer(req, request: Request, chat: bool):
        user_note = f" user={req.user}" if req.user else ""
        try:
            job = await off_loop(service.prepare_chat if chat else service.prepare, req)
            if req.stream:
                include = bool(req.stream_options and req.stream_options.include_usage)
                stream = _Stream(service, job, request, chat, include, user_note)
                return StreamingResponse(stream.events(), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            result = await _generate(service, job, request)
            if result is None:
                request.state.note = f"cancelled: the client left; {_note(job)}{user_note}"
                return _error(499, "the client closed the connection")
            body = await off_loop(service.respond_chat if chat else service.respond, job, result)
        except RequestError as exc:
            request.state.note = exc.message
            return _error(exc.status, exc.message, exc.param)
        except Exception as exc:  # the server keeps serving; the client learns what failed
            log.exception("generation failed")
            request.state.note = f"error: {exc}"
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}")
        request.state.note = _note(job) + user_note
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await answer(req, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await answer(req, request, chat=True)

    return app


def serve(service: ModelService, host: str, port: int, log_level: str = "info",
          stop: Optional[threading.Event] = None, api_key: Optional[str] = None) -> bool:
    """Serve until Ctrl-C or ``stop`` is set: uvicorn in a second thread, the model's jobs on
    this one. False if the server never started (e.g. the port is taken: uvicorn logs why).
    ``api_key``: requests must carry it (``create_app``)."""
    import uvicorn

    config = uvicorn.Config(create_app(service, api_key), host=host, port=port, log_level=log_level,
                            access_log=False)  # the middleware logs one line per request
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        stop = stop or threading.Event()
        service.run_jobs(lambda: thread.is_alive() and not stop.is_set())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return server.started
