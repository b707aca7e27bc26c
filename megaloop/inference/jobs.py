"""The server's model side (tools/serve.py, megaloop/inference/server.py): requests validated into
jobs, run by the batching engine on the model's thread (megaloop/inference/batcher.py), and the
responses built from a job's results.

Special tokens, one rule everywhere: a request's text (a completion prompt, a chat message, the
text of ``/tokenize``) is read with the pieces of the end-of-document and BOS tokens (``</s>``,
``<s>``; a Hugging Face tokenizer's added special tokens, as that library reads them) turned into
those tokens, as Hugging Face tokenizers read text. A prompt of token ids is taken as it is.

Where the numbers come from:

- a generated token's log-probs are those of the distribution it was drawn from (the logits the
  engine samples from, before temperature / top-k / top-p; with the server's KV policy and exit
  rule);
- a prompt token's log-probs come from one full forward of the prompt (no cache) through all
  ``--num-loops`` steps, read out at the last step (an ``--exit`` rule does not apply to them).

Each generated token passes through its row's per-token hook (``batcher.Row.on_token``): it
checks the stop strings (stopping the row there) and hands the text to a streaming response.
"""

import random
import re
import threading
import time
import uuid
from typing import Callable, Optional

import torch

from megaloop.inference.limits import RequestLimits
from megaloop.inference.openai_api import (ChatCompletionRequest, CompletionRequest,
                                           RequestError, usage)

# A chat request without max_tokens, for a model whose context is unknown.
DEFAULT_CHAT_TOKENS = 256


def check_text(value, field: str) -> None:
    """RequestError 400 naming ``field`` (a dotted path into the body) where a string in
    ``value`` is not Unicode text: a lone surrogate, which JSON's ``\\ud800`` escape spells and
    Python's parser keeps, and which no tokenizer reads (sentencepiece answers with its binding's
    internal message)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(400, f"{field} holds a lone surrogate (U+{ord(value[exc.start]):04X} "
                                    f"at character {exc.start}), which is not text: a JSON "
                                    f"\\uD800-\\uDFFF escape must be one half of a surrogate "
                                    f"pair; send valid UTF-8 text", re.split(r"[.\[]", field)[0]) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(v, f"{field}.{k}" if field else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{field}[{i}]")


class Job:
    """One request's validated work, its rows (every prompt ``n`` times, in the order of the
    response's choices) and, filled in on the model thread token by token, their results."""

    def __init__(self, prompts, n, max_tokens, params, stop, logprobs=None, echo=False,
                 ignore_eos=False):
        self.prompts, self.n, self.max_tokens, self.params = prompts, n, max_tokens, params
        self.stop, self.logprobs, self.echo, self.ignore_eos = stop, logprobs, echo, ignore_eos
        self.rows = [p for p in prompts for _ in range(n)]
        self.cancelled = threading.Event()
        # Streaming: emit(row, text, finish_reason or None), called on the model thread.
        self.emit: Optional[Callable] = None
        # Set on the model thread (batcher.JobRunner): each row's state, its engine keys and
        # finished Requests, the prompts' log-prob rows (echo), the job's future.
        self.state: list = []
        self.keys: list = []
        self.requests: dict = {}
        self.prompt_scores: dict = {}
        self.future = None
        self.error: Optional[Exception] = None  # a row's hook raised: the job fails
        self.depths: list = []  # executed loop steps of its decoded tokens (with --exit)

    @property
    def outs(self) -> list:  # generated ids of each row (EOD included)
        return [r.out for r in self.state] or [[] for _ in self.rows]

    @property
    def texts(self) -> list:  # each row's answer (ending before a stop string)
        return [r.text for r in self.state]

    @property
    def finish(self) -> list:
        return [r.finish for r in self.state]

    @property
    def cut(self) -> list:  # where a stop string cut each row's text (characters)
        return [r.cut for r in self.state]

    def usage(self) -> dict:
        return usage(sum(len(p) for p in self.prompts), sum(len(o) for o in self.outs))


class ModelService:
    """The loaded model, its tokenizer and how it generates: validates requests into jobs, runs
    them with the batching engine (on the thread that calls ``run_jobs``, the one that loaded the
    model; ``follow`` on the other tensor-parallel ranks), and builds the responses."""

    def __init__(self, model, tokenizer, model_name: str, num_loops: Optional[int] = None,
                 kv_policy: str = "full", exit_rule=None, max_length: Optional[int] = None,
                 limits: Optional[RequestLimits] = None, engine_config=None):
        from megaloop.inference.batcher import JobRunner
        from megaloop.inference.chat import ChatTemplate
        from megaloop.inference.engine import EngineConfig, InferenceEngine

        if engine_config is None:
            engine_config = EngineConfig(**({"max_sequence_length": max_length}
                                            if max_length else {}))
        self.engine_config = engine_config
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod
        self.max_length = max_length
        self.limits = limits or RequestLimits()
        self.created = int(time.time())
        self.num_loops = num_loops or model.loop.num_loops

        def new_engine():
            return InferenceEngine(model, self.vocab_size, num_loops=num_loops,
                                   kv_policy=kv_policy, eod=tokenizer.eod, exit_rule=exit_rule,
                                   config=engine_config)

        # Built now, so that a bad combination (an exit rule without a cache...) fails at
        # startup and its warnings print once.
        self.runner = JobRunner(tokenizer, new_engine, self.prompt_log_probs)
        self._specials = self._parsed_specials()
        self.chat = ChatTemplate(tokenizer, self.tokenize)

    # --- the model thread ---------------------------------------------------------------------
    def submit(self, job: Job):
        """Queue ``job`` for the model thread: a Future of its result (batcher.JobRunner)."""
        return self.runner.submit(job)

    def run_jobs(self, keep_going) -> None:
        self.runner.run_jobs(keep_going)

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: step in lockstep with rank 0 until it stops."""
        self.runner.follow()

    @property
    def serving(self) -> bool:
        return self.runner.serving

    @property
    def stats(self) -> dict:
        return self.runner.stats

    # --- tokenizer (event-loop thread) ----------------------------------------------------------
    def special_tokens(self) -> dict:
        """{name: (piece text, id)} of EOD and BOS (the names /tokenizer_info reports)."""
        ids = {"eos_token": self.tokenizer.eod, "bos_token": self.tokenizer.bos}
        return {name: (self.tokenizer.piece(i), i) for name, i in ids.items() if i is not None}

    def _parsed_specials(self) -> dict:
        """{piece: id} of the special tokens whose piece the tokenizer does not read as that
        token by itself (sentencepiece spells ``</s>`` out; the null tokenizer's "200" and a
        Hugging Face tokenizer's added tokens are already read as themselves)."""
        out = {}
        for piece, i in self.special_tokens().values():
            try:
                alone = list(self.tokenizer.tokenize(piece)) if piece else [i]
            except Exception:
                alone = None
            if alone != [i]:
                out[piece] = i
        return out

    def tokenize(self, text: str) -> list[int]:
        """Request text -> ids, its special tokens' pieces read as those tokens (the module
        docstring's rule)."""
        check_text(text, "prompt")
        out, rest = [], text
        while rest:
            hits = [(rest.find(p), p) for p in self._specials if p in rest]
            if not hits:
                out += self.tokenizer.tokenize(rest)
                break
            at, piece = min(hits)
            if at:
                out += self.tokenizer.tokenize(rest[:at])
            out.append(self._specials[piece])
            rest = rest[at + len(piece):]
        return [int(i) for i in out]

    # --- request -> job (event-loop thread) ---------------------------------------------------
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise RequestError(404, f"model {name!r} is not served here; this server serves "
                                    f"{self.model_name!r}", "model")

    def prepare(self, req: CompletionRequest) -> Job:
        self._check_body(req)
        if req.logprobs is not None and req.stream:
            raise RequestError(400, "logprobs with stream: true is not supported; ask without "
                                    "stream for log-probs", "logprobs")
        prompts = self._prompt_ids(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        return self._job(req, prompts, max_tokens, req.logprobs, req.echo)

    def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        from jinja2.exceptions import TemplateError

        self._check_body(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self.chat.ids(messages)
        except (TemplateError, ValueError) as exc:  # e.g. the null tokenizer reads only ids
            raise RequestError(400, f"the messages cannot be put into a prompt with the "
                                    f"{self.chat.kind} chat template: {exc}", "messages") from None
        self._check_ids(ids)
        logprobs = req.logprobs_n()
        if logprobs is not None and req.stream:
            raise RequestError(400, "logprobs with stream: true is not supported; ask without "
                                    "stream for log-probs", "logprobs")
        max_tokens = req.token_budget()
        if max_tokens is None:  # what is left of the context, within the request's limit
            context = self.max_length or len(ids) + DEFAULT_CHAT_TOKENS
            max_tokens = max(0, min(context - len(ids),
                                    self.limits.max_request_tokens // (req.n or 1) - len(ids)))
        return self._job(req, [ids], max_tokens, logprobs)

    def _check_body(self, req) -> None:
        """What needs no tokenizing, checked first (cheap, and the same whatever the prompt)."""
        from megaloop.inference.flags import check_seed

        self.check_model(req.model)
        req.refuse_unknown()
        check_text(req.model_dump(), "")
        if req.seed is not None:
            try:
                check_seed(req.seed, spell=str)
            except ValueError as exc:
                raise RequestError(400, str(exc), "seed") from None

    def _job(self, req, prompts: list, max_tokens: int, logprobs=None, echo=False) -> Job:
        from megaloop.inference.flags import check_sampling, fit_prompt
        from megaloop.inference.sampling import SamplingParams

        n, lim = req.n or 1, self.limits
        self._check_prompt_count(len(prompts))
        if n > lim.max_n:
            raise RequestError(400, f"n {n}: this server gives at most {lim.max_n} choices per "
                                    f"prompt (--max-n)", "n")
        tokens = n * sum(len(p) + max_tokens for p in prompts)
        if tokens > lim.max_request_tokens:
            raise RequestError(400, f"the request occupies {tokens} tokens (prompt tokens plus "
                                    f"max_tokens, for each of its {n * len(prompts)} rows); this "
                                    f"server takes at most {lim.max_request_tokens} per request "
                                    f"(--max-request-tokens)", "max_tokens")
        for i, p in enumerate(prompts):
            try:
                fit_prompt(p, max_tokens, self.max_length, spell=str,
                           what="the prompt" if len(prompts) == 1 else f"prompt {i}")
            except ValueError as exc:
                raise RequestError(400, str(exc), "max_tokens") from None
            if max_tokens > 0:
                self._check_engine_fit(len(p) + max_tokens)
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
        return Job(prompts, n, max_tokens, params, stop, logprobs, echo, bool(req.ignore_eos))

    def _check_prompt_count(self, count: int) -> None:
        if count > self.limits.max_prompts_per_request:
            raise RequestError(400, f"the request has {count} prompts; this server takes at most "
                                    f"{self.limits.max_prompts_per_request} per request "
                                    f"(--max-prompts-per-request)", "prompt")

    def _check_engine_fit(self, total: int) -> None:
        """One row of ``total`` tokens (prompt plus max_tokens) fits the engine's limits."""
        cfg, allocator = self.engine_config, self.runner.lockstep.engine.allocator
        if total > cfg.max_sequence_length:
            raise RequestError(400, f"a row of {total} tokens (prompt plus max_tokens) exceeds "
                                    f"the engine's {cfg.max_sequence_length} tokens per row; "
                                    f"shorten the prompt or lower max_tokens", "max_tokens")
        if allocator.blocks_for(total) > allocator.num_blocks:
            raise RequestError(400, f"a row of {total} tokens (prompt plus max_tokens) needs "
                                    f"{allocator.blocks_for(total)} KV blocks; this server has "
                                    f"{allocator.num_blocks} (--num-blocks)", "max_tokens")

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            texts_or_ids = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            texts_or_ids = [prompt]  # one prompt of token ids
        else:
            texts_or_ids = list(prompt)
        if not texts_or_ids:
            raise RequestError(400, "prompt is an empty list", "prompt")
        self._check_prompt_count(len(texts_or_ids))  # before tokenizing them all
        out = []
        for p in texts_or_ids:
            if isinstance(p, str):
                try:
                    p = self.tokenize(p)
                except Exception as exc:  # e.g. the null tokenizer reads only integers
                    raise RequestError(400, f"the tokenizer cannot read the prompt: {exc}",
                                       "prompt") from None
            self._check_ids(p)
            out.append([int(i) for i in p])
        return out

    def _check_ids(self, ids: list[int]) -> None:
        if len(ids) == 0:
            raise RequestError(400, "every prompt needs at least one token", "prompt")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(400, f"token id {bad[0]} is outside the vocabulary (size "
                                    f"{self.vocab_size})", "prompt")

    # --- the model's work (model thread) ------------------------------------------------------
    @torch.no_grad()
    def prompt_log_probs(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced log-probs [len(ids) - 1, V]: row j is the distribution of token j + 1
        given tokens 0..j, from the full forward's last loop step (no cache)."""
        from megaloop.model.readout import gather_logits

        from megaloop.device import current_device

        self.model.eval()
        device = current_device()
        x = torch.tensor([ids], dtype=torch.long, device=device)
        pos = torch.arange(len(ids), device=device).unsqueeze(0)
        logits = self.model(x, pos, None, num_loops=self.num_loops)
        logits = gather_logits(logits)
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

    def _logprobs(self, job: Job, i: int, rows, prompt_rows) -> dict:
        prompt, out = job.rows[i], job.outs[i]
        if out and out[-1] == self.eod and not job.ignore_eos:
            out = out[:-1]
        entries, start = [], len(self.tokenizer.detokenize(prompt))
        if job.echo:
            offset = 0
            for piece, lp, top in self._token_logprobs(
                    [], prompt, [None] + list(prompt_rows), job.logprobs):
                entries.append((piece, lp, top, offset))
                offset += len(piece)
        offset, cut = start, job.cut[i]
        for piece, lp, top in self._token_logprobs(prompt, out, rows, job.logprobs):
            if cut is not None and offset - start >= cut:
                break  # at or after the stop string
            entries.append((piece, lp, top, offset))
            offset += len(piece)
        tokens, token_lps, tops, offsets = (list(x) for x in zip(*entries)) if entries \
            else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def respond(self, job: Job, result) -> dict:
        rows, prompt_rows = result
        choices = []
        for i in range(len(job.rows)):
            text = job.texts[i]
            if job.echo:
                text = self.tokenizer.detokenize(job.rows[i]) + text
            logprobs = None if job.logprobs is None else \
                self._logprobs(job, i, rows[i], prompt_rows[i])
            choices.append({"text": text, "index": i, "logprobs": logprobs,
                            "finish_reason": job.finish[i]})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": job.usage()}

    def respond_chat(self, job: Job, result) -> dict:
        rows, _ = result
        choices = []
        for i in range(len(job.rows)):
            logprobs = None
            if job.logprobs is not None:  # the chat format of the same numbers
                lp = self._logprobs(job, i, rows[i], None)

                def entry(token, value):
                    return {"token": token, "logprob": value, "bytes": list(token.encode())}

                logprobs = {"content": [
                    {**entry(t, v), "top_logprobs": [entry(*kv) for kv in
                                                     list(top.items())[:job.logprobs]]}
                    for t, v, top in zip(lp["tokens"], lp["token_logprobs"],
                                         lp["top_logprobs"])], "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant",
                                                    "content": job.texts[i]},
                            "logprobs": logprobs, "finish_reason": job.finish[i]})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": job.usage()}
