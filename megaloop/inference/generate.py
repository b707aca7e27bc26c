"""Token generation with a looped model: the batching engine's synchronous face.

``Generator.generate`` submits every prompt to an ``InferenceEngine``
(megaloop/inference/engine.py) and steps it until all are done, so tools/generate.py, the
lm-eval adapter, the RL rollouts and tools/serve.py decode through one loop. Prompt i is the
engine's request with random stream i of ``SamplingParams.seed`` (megaloop/inference/sampling.py):
its tokens are those it gets alone, whatever its batch-mates, and every tensor-parallel rank
draws the same ones (all ranks submit the same prompts and the engine's schedule is a function of
them). A prompt is prefilled in one forward (prompts of one length share it), then each row
advances one token per decode forward; a row stops at the end-of-document token or after
``max_tokens``. With ``kv_policy`` none the engine recomputes the whole sequence for every new
token; a KV policy's cache gives the same logits under ``full`` (tests/test_inference.py).
``speculate`` drafts and verifies several tokens per forward instead (self-speculative decoding,
megaloop/inference/speculation.py), with the same tokens under greedy decoding.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from megaloop.inference.engine import EngineConfig, InferenceEngine
from megaloop.inference.flags import check_num_loops, check_sampling
# (defined below the engine, which takes it too; imported from here by the tools and tests)
from megaloop.inference.sampling import SamplingParams  # noqa: F401


def continuation_text(tokenizer, prompt: list[int], out: list[int],
                      before: Optional[str] = None) -> str:
    """The text ``out`` adds after ``prompt``: decoded with the prompt, so that a word boundary's
    space lands where the tokenizer puts it (decoding ``out`` alone drops a sentencepiece
    continuation's leading space; joining two decodings with a space adds one before
    punctuation)."""
    if before is None:  # (a caller that asks token by token passes the prompt's text once)
        before = tokenizer.detokenize(prompt)
    whole = tokenizer.detokenize(list(prompt) + list(out))
    return whole[len(before):] if whole.startswith(before) else tokenizer.detokenize(out)


class Generator:
    """Generates continuations of token-id prompts with a LoopedGPTModel (TP >= 1, PP = 1)."""

    def __init__(self, model, vocab_size: int, num_loops: Optional[int] = None,
                 kv_policy: str = "full", eod: Optional[int] = None, exit_rule=None,
                 record_logprobs: bool = False, speculate: str = ""):
        """``speculate``: the engine's ``EngineConfig.speculate`` (``d:k``; "": off)."""
        check_num_loops(num_loops, spell=str)  # 0 must not silently mean the trained depth
        self.model, self.vocab_size, self.eod = model, vocab_size, eod
        self.num_loops = num_loops or model.loop.num_loops
        self.kv_policy, self.exit_rule, self.speculate = kv_policy, exit_rule, speculate
        self.depths: list = []  # executed loop steps of every decoded token (early exit)
        # Of the last generate(): seconds of the prefill forwards and of the rest, the decode
        # forwards, the KV cache's bytes, and under speculate the drafted and kept tokens.
        self.stats: dict = {}
        self.record_logprobs = record_logprobs  # each token's [V] log-softmax (Request.logprobs)
        self.requests: list = []  # the last generate()'s engine requests, one per prompt
        # Refuse what the engine cannot decode now, not at the first generate().
        InferenceEngine(model, vocab_size, self.num_loops, kv_policy, eod, exit_rule,
                        EngineConfig(max_sequence_length=1, max_batch=1, speculate=speculate))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: SamplingParams = SamplingParams(),
                 on_token: Optional[Callable[[int, int], bool]] = None) -> list[list[int]]:
        """The generated ids of every prompt (without the prompt), EOD included if reached.

        ``on_token(row, token)`` is called after each token is sampled (right after its forward,
        so that a caller can stream it); True stops that row there (e.g. its text now holds a
        stop string). An exception it raises ends the whole call (e.g. the client left), as
        does a row whose logits cannot be sampled (ValueError naming the row)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        check_sampling(params.temperature, params.top_k, params.top_p, spell=str)
        lengths = [len(p) for p in prompts]
        engine = InferenceEngine(
            self.model, self.vocab_size, self.num_loops, self.kv_policy, self.eod,
            self.exit_rule, EngineConfig(max_sequence_length=max(lengths) + max_tokens,
                                         max_batch=len(prompts), prefill_chunk=max(lengths),
                                         prefill_budget=sum(lengths),
                                         speculate=self.speculate))
        row_of: dict = {}

        def call(request, token):
            return on_token(row_of[request.id], token)

        requests = []
        for i, prompt in enumerate(prompts):
            request = engine.add(prompt, max_tokens, params, stream=i,
                                 on_token=call if on_token is not None else None,
                                 record_logprobs=self.record_logprobs)
            row_of[request.id] = i
            requests.append(request)
        clock = time.perf_counter()
        while engine.has_work():
            for request in engine.step():
                if request.error is not None:
                    for other in requests:
                        engine.cancel(other)
                    engine.step()  # frees the others' blocks
                    error = request.error
                    if isinstance(error, ValueError) and "cannot sample" in str(error):
                        raise ValueError(f"row {row_of[request.id]}: {error}") from None
                    raise error
        elapsed = time.perf_counter() - clock
        s = engine.stats
        self.stats = {"prefill_s": s["prefill_s"], "decode_s": elapsed - s["prefill_s"],
                      "decode_forwards": s["decode_forwards"], "kv_bytes": s["kv_bytes"],
                      "drafted": s["drafted"], "accepted": s["accepted"]}
        self.requests = requests
        for request in requests:  # (the first token was read at the prefill)
            self.depths.extend(request.depths[1:])
        return [request.out for request in requests]
