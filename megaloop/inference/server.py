"""An OpenAI-compatible completions server for a looped model (``tools/serve.py``).

Endpoints: ``GET /v1/models``, vLLM's tokenizer endpoints (``GET /tokenizer_info``,
``POST /tokenize``, ``POST /detokenize``: lm-evaluation-harness's ``local-completions`` model
tokenizes through them) and ``POST /v1/completions`` with the legacy completions API's
fields: ``model``, ``prompt`` (a text, a list of texts, a list of token ids or a list of lists
of ids), ``max_tokens`` (default 16), ``temperature`` (default 1; 0 = greedy), ``top_p``,
``top_k`` and ``seed`` (extensions; no seed: a fresh one per request), ``stop`` (a string or a
list: the text is cut before the first stop string), ``logprobs`` (N: the top-N log-probs of
every returned token, always with the chosen token's) and ``echo`` (the prompt is returned
too; with ``logprobs`` its tokens get teacher-forced log-probs, the first ``null`` as OpenAI's).
``echo`` + ``logprobs`` + ``max_tokens`` 0 or 1 is what lm-evaluation-harness's
``local-completions`` model sends to score log-likelihoods.

Where the numbers come from:

- a generated token's log-probs are those of the distribution it was drawn from (the logits the
  ``Generator`` samples from, before temperature / top-k / top-p; with the server's KV policy and
  exit rule);
- a prompt token's log-probs come from one full forward of the prompt (no cache) through all
  ``--num-loops`` steps, read out at the last step (an ``--exit`` rule does not apply to them).

Threads. The model is not re-entrant, and its process state is per thread (the CUDA current
device; on CPU the shim's device-rewriting mode). So the model runs on the thread that loaded it
(the main thread), which takes one job at a time from a queue: that queue is the generation lock
through which all requests are serialised. uvicorn's event loop runs in a second thread;
validation, tokenization and the response's text happen there, generation waits on the queue.

Tensor parallelism: one process at TP=1 only (``tools/serve.py`` refuses a torchrun launch).
Serving at TP>1 would need every rank to run each request's forwards in step; not done yet.
"""

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
import uuid
from typing import List, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

log = logging.getLogger("megaloop.serve")

MAX_LOGPROBS = 20


class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (unknown fields are ignored, as OpenAI clients send
    some this server has no use for)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0)
    # Ranges are checked by megaloop.inference.flags.check_sampling, as on generate.py's
    # command line (one message for one mistake, wherever it is made).
    temperature: Optional[StrictFloat] = 1.0
    top_p: Optional[StrictFloat] = 1.0
    top_k: Optional[StrictInt] = 0
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    n: StrictInt = 1
    stream: StrictBool = False


class TokenizeRequest(BaseModel):
    """The body of ``POST /tokenize`` (vLLM's form, which lm-eval's remote tokenizer sends)."""

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    """The body of ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    tokens: List[StrictInt]


class _Job:
    """One request's validated work: token-id prompts and how to continue them."""

    def __init__(self, prompts, max_tokens, params, logprobs, echo, stop):
        self.prompts, self.max_tokens, self.params = prompts, max_tokens, params
        self.logprobs, self.echo, self.stop = logprobs, echo, stop
        self.depths: list = []  # executed loop steps of its decoded tokens (with --exit)


def _recording_generator_class():
    from megaloop.inference.generate import Generator

    class RecordingGenerator(Generator):
        """A Generator that keeps the log-softmax of the logits each forward samples from
        (``[b, V]`` per forward, on the CPU) when ``record`` is a list."""

        record: Optional[list] = None

        def _logits(self, ids, kv):
            logits = super()._logits(ids, kv)
            if self.record is not None:
                self.record.append(torch.log_softmax(logits[:, -1].float(), -1).cpu())
            return logits

    return RecordingGenerator


class Engine:
    """The loaded model, its tokenizer and how it generates; runs jobs on the thread that calls
    ``run_jobs`` (the one that loaded the model)."""

    def __init__(self, model, tokenizer, model_name: str, num_loops: Optional[int] = None,
                 kv_policy: str = "full", exit_rule=None, max_length: Optional[int] = None):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod
        self.max_length = max_length
        self.created = int(time.time())
        self._gen_kw = dict(num_loops=num_loops, kv_policy=kv_policy, exit_rule=exit_rule,
                            eod=tokenizer.eod)
        # Built once, so that a bad combination (an exit rule without a cache...) fails at
        # startup and its warnings print once; used by one request at a time.
        self._gen = _recording_generator_class()(self.model, self.vocab_size, **self._gen_kw)
        self.num_loops = self._gen.num_loops
        self._queue: queue.Queue = queue.Queue()

    # --- the model thread ---------------------------------------------------------------------
    def submit(self, fn) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn))
        return future

    def run_jobs(self, keep_going) -> None:
        """Run queued jobs one at a time while ``keep_going()``."""
        while keep_going():
            try:
                future, fn = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # reported to the request that sent it
                future.set_exception(exc)
            except BaseException as exc:  # Ctrl-C / SIGTERM: the request fails, the server stops
                future.set_exception(RuntimeError("the server is shutting down"))
                raise exc

    # --- tokenizer endpoints (event-loop thread) ------------------------------------------------
    def special_tokens(self) -> dict:
        """{piece text: id} of EOD and BOS: a prompt that writes one gets that token, as Hugging
        Face tokenizers parse their special tokens (sentencepiece would spell ``</s>`` out)."""
        ids = {"eos_token": self.tokenizer.eod, "bos_token": self.tokenizer.bos}
        return {name: (self.tokenizer.piece(i), i) for name, i in ids.items() if i is not None}

    def tokenize(self, text: str) -> list[int]:
        specials = {piece: i for piece, i in self.special_tokens().values() if piece}
        out, rest = [], text
        while rest:
            hits = [(rest.find(p), p) for p in specials if p in rest]
            if not hits:
                out += self.tokenizer.tokenize(rest)
                break
            at, piece = min(hits)
            if at:
                out += self.tokenizer.tokenize(rest[:at])
            out.append(specials[piece])
            rest = rest[at + len(piece):]
        return [int(i) for i in out]

    # --- request -> job (event-loop thread) ---------------------------------------------------
    def prepare(self, req: CompletionRequest) -> _Job:
        from megaloop.inference.generate import SamplingParams

        if req.model is not None and req.model != self.model_name:
            raise RequestError(404, f"model {req.model!r} is not served here; this server "
                                    f"serves {self.model_name!r}", "model")
        if req.n != 1:
            raise RequestError(400, "only n=1 is supported", "n")
        if req.stream:
            raise RequestError(400, "streaming is not supported", "stream")
        from megaloop.inference.flags import check_sampling, fit_prompt

        prompts = self._prompt_ids(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for i, p in enumerate(prompts):
            try:
                fit_prompt(p, max_tokens, self.max_length, spell=str,
                           what="the prompt" if len(prompts) == 1 else f"prompt {i}")
            except ValueError as exc:
                raise RequestError(400, str(exc), "max_tokens") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise RequestError(400, "stop strings must not be empty", "stop")
        seed = req.seed if req.seed is not None else random.randrange(2 ** 31)
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else float(req.top_p),
            seed=seed)
        try:
            check_sampling(params.temperature, params.top_k, params.top_p, spell=str)
        except ValueError as exc:
            raise RequestError(400, str(exc), str(exc).split()[0]) from None
        return _Job(prompts, max_tokens, params, req.logprobs, req.echo, stop)

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            texts_or_ids = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            texts_or_ids = [prompt]  # one prompt of token ids
        else:
            texts_or_ids = list(prompt)
        if not texts_or_ids:
            raise RequestError(400, "prompt is an empty list", "prompt")
        out = []
        for p in texts_or_ids:
            if isinstance(p, str):
                try:
                    p = list(self.tokenizer.tokenize(p))
                except Exception as exc:  # e.g. the null tokenizer reads only integers
                    raise RequestError(400, f"the tokenizer cannot read the prompt: {exc}",
                                       "prompt") from None
            if len(p) == 0:
                raise RequestError(400, "every prompt needs at least one token", "prompt")
            bad = [i for i in p if not 0 <= i < self.vocab_size]
            if bad:
                raise RequestError(400, f"token id {bad[0]} is outside the vocabulary (size "
                                        f"{self.vocab_size})", "prompt")
            out.append([int(i) for i in p])
        return out

    # --- the model's work (model thread) ------------------------------------------------------
    def run(self, job: _Job):
        """(generated ids per prompt, their log-prob rows [n, V] or None, the prompts'
        teacher-forced log-prob rows [len - 1, V] or None)."""
        generated = [[] for _ in job.prompts]
        rows = [None] * len(job.prompts)
        job.depths = []
        if job.max_tokens > 0:
            gen = self._gen
            gen.depths = []  # (early exit) the executed steps of this request's tokens
            gen.record = [] if job.logprobs is not None else None
            try:
                generated = gen.generate(job.prompts, job.max_tokens, job.params)
            finally:
                record, gen.record = gen.record, None
            job.depths = gen.depths
            if record is not None:
                first = min(len(p) for p in job.prompts)
                # The forward at index f predicts position first + f of every row.
                rows = [torch.stack([record[len(p) - first + j][i] for j in range(len(out))])
                        if out else None
                        for i, (p, out) in enumerate(zip(job.prompts, generated))]
        prompt_rows = [None] * len(job.prompts)
        if job.echo and job.logprobs is not None:
            prompt_rows = [self.prompt_log_probs(p) for p in job.prompts]
        return generated, rows, prompt_rows

    @torch.no_grad()
    def prompt_log_probs(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced log-probs [len(ids) - 1, V]: row j is the distribution of token j + 1
        given tokens 0..j, from the full forward's last loop step (no cache)."""
        from megatron.core import tensor_parallel

        from megaloop.device import current_device

        self.model.eval()
        device = current_device()
        x = torch.tensor([ids], dtype=torch.long, device=device)
        pos = torch.arange(len(ids), device=device).unsqueeze(0)
        logits = self.model(x, pos, None, num_loops=self.num_loops)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return torch.log_softmax(logits[0, :-1, :self.vocab_size].float(), -1).cpu()

    # --- job result -> response (event-loop thread) -------------------------------------------
    def _piece(self, ctx: list[int], t: int) -> str:
        """The text token ``t`` adds after the ids ``ctx`` (decoded with the tokens before it, so
        that a word-boundary space lands on the token that carries it)."""
        before = self.tokenizer.detokenize(ctx) if ctx else ""
        after = self.tokenizer.detokenize(ctx + [t])
        return after[len(before):] if after.startswith(before) else \
            self.tokenizer.detokenize([t])

    def _token_logprobs(self, context: list[int], ids: list[int], rows, n: int,
                        window: int = 16):
        """(piece, chosen log-prob, top-N dict) of every token of ``ids`` after ``context``;
        ``rows[j]`` is the log-prob row token j was drawn from (None: the first prompt token).
        The top-N dict always holds the chosen token too (as OpenAI's)."""
        out, ctx = [], list(context[-window:])
        for j, t in enumerate(ids):
            piece = self._piece(ctx, t)
            row = rows[j]
            if row is None:
                out.append((piece, None, None))
            else:
                top = {}
                if n > 0:
                    values, top_ids = row.topk(min(n, row.numel()))
                    for v, i in zip(values.tolist(), top_ids.tolist()):
                        top.setdefault(piece if i == t else self._piece(ctx, i), v)
                top.setdefault(piece, float(row[t]))
                out.append((piece, float(row[t]), top))
            ctx = (ctx + [t])[-window:]
        return out

    def choice(self, index: int, job: _Job, prompt: list[int], out: list[int],
               rows: Optional[torch.Tensor], prompt_rows: Optional[torch.Tensor]) -> dict:
        finish = "length"
        if out and out[-1] == self.eod:
            out, finish = out[:-1], "stop"
        elif len(out) < job.max_tokens:
            finish = "stop"
        from megaloop.inference.generate import continuation_text

        prompt_text = self.tokenizer.detokenize(prompt)
        text = continuation_text(self.tokenizer, prompt, out) if out else ""
        cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        logprobs = None
        if job.logprobs is not None:
            entries, start = [], len(prompt_text)
            if job.echo:
                offset = 0
                for piece, lp, top in self._token_logprobs(
                        [], prompt, [None] + list(prompt_rows), job.logprobs):
                    entries.append((piece, lp, top, offset))
                    offset += len(piece)
            offset = start
            for piece, lp, top in self._token_logprobs(prompt, out, rows, job.logprobs):
                if cut >= 0 and offset - start >= cut:
                    break  # at or after the stop string
                entries.append((piece, lp, top, offset))
                offset += len(piece)
            tokens, token_lps, tops, offsets = (list(x) for x in zip(*entries)) if entries \
                else ([], [], [], [])
            logprobs = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                        "text_offset": offsets}
        return {"text": prompt_text + text if job.echo else text, "index": index,
                "logprobs": logprobs, "finish_reason": finish}

    def respond(self, job: _Job, result) -> dict:
        generated, rows, prompt_rows = result
        choices = [self.choice(i, job, p, out, r, pr) for i, (p, out, r, pr) in
                   enumerate(zip(job.prompts, generated, rows, prompt_rows))]
        prompt_tokens = sum(len(p) for p in job.prompts)
        completion_tokens = sum(len(out) for out in generated)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


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
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    # A union (prompt) reports one error per alternative: keep the first few.
    return "; ".join(dict.fromkeys(parts[:4])) or "invalid request"


def create_app(engine: Engine):
    """The FastAPI application serving ``engine``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="megaloop", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def log_request(request: Request, call_next):  # one line per request
        start = time.perf_counter()
        request.state.note = ""
        try:
            response = await call_next(request)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            raise
        note = getattr(request.state, "note", "")
        log.info("%s %s %d %.3fs%s", request.method, request.url.path, response.status_code,
                 time.perf_counter() - start, f" {note}" if note else "")
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message = _validation_message(exc.errors())
        request.state.note = message
        return _error(400, message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": engine.created,
            "owned_by": "megaloop", "max_model_len": engine.max_length}]}

    # vLLM's tokenizer endpoints: lm-eval's local-completions finds them and tokenizes with the
    # served model's own tokenizer (no Hugging Face tokenizer needed on the client).
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        specials = engine.special_tokens()
        return {"tokenizer_class": type(engine.tokenizer).__name__,
                "eos_token": specials["eos_token"][0],
                "bos_token": specials["bos_token"][0] if "bos_token" in specials else None,
                "pad_token": None, "model_max_length": engine.max_length,
                "vocab_size": engine.vocab_size}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        tokens = engine.tokenize(req.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_length}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        bad = [i for i in req.tokens if not 0 <= i < engine.vocab_size]
        if bad:
            return _error(400, f"token id {bad[0]} is outside the vocabulary (size "
                               f"{engine.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.detokenize(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            job = engine.prepare(req)
            result = await asyncio.wrap_future(engine.submit(lambda: engine.run(job)))
            body = engine.respond(job, result)
        except RequestError as exc:
            request.state.note = exc.message
            return _error(exc.status, exc.message, exc.param)
        except Exception as exc:  # the server keeps serving; the client learns what failed
            log.exception("completion failed")
            request.state.note = f"error: {exc}"
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}")
        usage = body["usage"]
        request.state.note = (f"prompts={len(job.prompts)} prompt_tokens={usage['prompt_tokens']}"
                              f" completion_tokens={usage['completion_tokens']}")
        if job.depths:
            request.state.note += f" mean_depth={sum(job.depths) / len(job.depths):.2f}"
        return body

    return app


def serve(engine: Engine, host: str, port: int, log_level: str = "info",
          stop: Optional[threading.Event] = None) -> bool:
    """Serve until Ctrl-C or ``stop`` is set: uvicorn in a second thread, the model's jobs on
    this one. False if the server never started (e.g. the port is taken: uvicorn logs why)."""
    import uvicorn

    config = uvicorn.Config(create_app(engine), host=host, port=port, log_level=log_level,
                            access_log=False)  # the middleware logs one line per request
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        stop = stop or threading.Event()
        engine.run_jobs(lambda: thread.is_alive() and not stop.is_set())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return server.started
