"""lm-evaluation-harness model ``megaloop``: a looped checkpoint scored and sampled by lm-eval.

Importing this module registers the model (lm-eval registers models by import;
``tools/run_lm_eval.py`` imports it and then runs lm-eval's own command line). Model arguments
(``--model_args key=value,...``):

- ``load``: a megaloop checkpoint directory or an exported Hugging Face folder (required);
- ``ckpt_step``: the checkpoint iteration to load (the trainer's ``--ckpt-step``; default: the
  latest);
- ``num_loops``: inference depth (default: the trained loop count);
- ``exit``: early-exit rule, ``q:<q>`` | ``kl:<eps>`` | ``fixed:<n>`` (default: none, all steps):
  log-likelihoods read each token at its teacher-forced exit step, generation exits per token;
- ``kv_policy``: the generation KV cache (``full``, ``last-step``, ``first-step``,
  ``shared-mod-<k>``, ``none``; default ``full``);
- ``bf16`` / ``fp16`` / ``fp32`` (``bf16=true``): the precision the model is held in, at most one
  (tools/generate.py's ``--bf16`` / ``--fp16`` / ``--fp32``; default: on a GPU the checkpoint's,
  bf16 if it trained with --bf16; on CPU fp32);
- ``max_length``: context length (default: the checkpoint's --seq-length);
- ``tokenizer_type`` / ``tokenizer_model`` / ``vocab_size``: for an exported folder without
  tokenizer.json.

Any other key is refused by name with the list of these (a misspelt ``nmu_loops=1`` must not run
the trained depth), and so are values out of range (``num_loops=0``), with the checks
tools/generate.py applies to its flags (megaloop/inference/flags.py).

``--batch_size`` sets how many requests share a forward. Each request type shows a bar over its
requests on stderr (a demo task takes minutes); ``MegaloopLM.progress = False`` (set by
tools/run_lm_eval.py's ``--no-progress``) turns them off, with lm-eval's tokenization bar.
Log-likelihoods are the model's teacher-forced log-probabilities over the real vocabulary (padded
rows dropped), as ``tools/serve.py`` returns them, so lm-eval's ``local-completions`` model
against the server gets the same numbers. Tokenization follows lm-eval's causal-LM convention
(``TemplateLM``: the context's trailing spaces move to the continuation; the pair is encoded whole
and split).
One process (TP = 1): lm-eval drives the requests; tensor parallelism is for tools/evaluate.py.
"""

from __future__ import annotations

import os
from typing import Optional

import lm_eval.models  # noqa: F401  (fills lm-eval's model table before ours joins it)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm


class ModelArgsError(ValueError):
    """A ``--model_args`` value the megaloop model refuses (tools/run_lm_eval.py prints it as one
    line and exits with code 2)."""


# The keys MegaloopLM takes (batch_size also arrives from lm-eval's --batch_size); a refused
# key's message lists them.
MODEL_ARGS = ("load", "ckpt_step", "num_loops", "exit", "kv_policy", "bf16", "fp16", "fp32",
              "max_length", "max_gen_toks", "tokenizer_type", "tokenizer_model", "vocab_size",
              "seed", "batch_size")


def check_model_args(unknown: dict, *, load, max_length, batch_size, max_gen_toks,
                     max_batch_size) -> None:
    """ModelArgsError for an unknown key (a typo must not be ignored) and for values the model
    cannot use; the range checks of num_loops and the generation keys are
    megaloop.inference.flags', shared with tools/generate.py and tools/serve.py."""
    import difflib

    for key, value in unknown.items():
        close = difflib.get_close_matches(key, MODEL_ARGS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ModelArgsError(f"{key}={value}: unknown key{hint}; the megaloop model takes "
                             f"{', '.join(MODEL_ARGS)}")
    if not load:
        raise ModelArgsError("load is required: load=CKPT (a megaloop checkpoint directory or "
                             "an exported folder)")
    if not str(batch_size).isdigit() or int(batch_size) < 1:
        raise ModelArgsError(f"batch_size {batch_size}: the megaloop model takes a whole number "
                             f"of requests per forward, at least 1 (no 'auto')")
    if max_batch_size is not None:
        raise ModelArgsError(f"max_batch_size {max_batch_size}: it bounds --batch_size auto, "
                             f"which the megaloop model does not take; leave it out")
    for key, value in (("max_length", max_length), ("max_gen_toks", max_gen_toks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ModelArgsError(f"{key} {value}: must be a whole number of tokens, at least 1")


# lm-eval sends ``device`` whatever the user asked: its default, cuda:0, also on a machine
# without a GPU, so that value cannot be told from a request and is not a conflict.
LM_EVAL_DEFAULT_DEVICE = "cuda:0"


def check_device(device: Optional[str]) -> None:
    """ModelArgsError for a ``device`` other than the one the model is placed on: like every
    megaloop tool, the GPU of LOCAL_RANK where there is one, else the CPU."""
    if device is None or device == LM_EVAL_DEFAULT_DEVICE:
        return
    if torch.cuda.is_available():
        placed = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        fits = device in ("cuda", placed)
    else:
        placed, fits = "cpu", device == "cpu"
    if not fits:
        raise ModelArgsError(f"device {device}: the megaloop model is placed on {placed} (the GPU "
                             f"of LOCAL_RANK where there is one, else the CPU); leave --device "
                             f"out or name {placed}")


@register_model("megaloop")
class MegaloopLM(TemplateLM):
    """A looped LM trained by megaloop, in lm-eval's interface."""

    progress = True
    """Progress bars over the requests (False: none, also for lm-eval's own tokenization bar,
    whatever lm-eval's ``disable_tqdm`` says)."""

    def __init__(self, load: Optional[str] = None, ckpt_step: Optional[int] = None,
                 num_loops: Optional[int] = None,
                 exit: Optional[str] = None, kv_policy: str = "full",
                 bf16: bool = False, fp16: bool = False, fp32: bool = False,
                 max_length: Optional[int] = None, batch_size=1, max_gen_toks: int = 256,
                 tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                 vocab_size: Optional[int] = None, seed: int = 1234,
                 max_batch_size: Optional[int] = None, device: Optional[str] = None,
                 **unknown):
        super().__init__()
        from megaloop import runtime
        from megaloop.data.config import TokenizerConfig
        from megaloop.inference.generate import Generator
        from megaloop.inference.loading import (check_generation_flags, load_for_generation,
                                                setup_processes)
        from megaloop.inference.precision import PrecisionConfig

        check_model_args(unknown, load=load, max_length=max_length, batch_size=batch_size,
                         max_gen_toks=max_gen_toks, max_batch_size=max_batch_size)
        check_device(device)
        precision = PrecisionConfig(bf16=bf16, fp16=fp16, fp32=fp32)
        try:
            precision.validate(spell=str)
            rule = check_generation_flags(load, kv_policy, exit, num_loops, spell=str,
                                          ckpt_step=ckpt_step)
        except ValueError as exc:
            raise ModelArgsError(str(exc)) from None
        tokenizer_cfg = None
        if tokenizer_type:
            tokenizer_cfg = TokenizerConfig(tokenizer_type, tokenizer_model,
                                            None if vocab_size is None else int(vocab_size))
            tokenizer_cfg.validate()
        runtime.quiet_megatron()
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            if setup_processes(int(seed)) != 1:
                raise ValueError("the megaloop lm-eval model runs in one process (TP = 1); "
                                 "launch without torchrun")
        self.model, self.tokenizer_, run = load_for_generation(load, 1, tokenizer=tokenizer_cfg,
                                                               ckpt_step=ckpt_step,
                                                               precision=precision, spell=str)
        self.vocab_size = self.tokenizer_.vocab_size
        self.num_loops = num_loops or self.model.loop.num_loops
        # What this model can run (a depth, the exit rule scored and decoded), named as
        # --model_args spells it.
        reason = self.model.loop.supports(depth=self.num_loops, exit=rule, kv_policy=kv_policy,
                                          spell=str)
        if reason:
            raise ModelArgsError(reason)
        self.rule = rule
        trained_length = run.get("training", {}).get("seq_length")
        self._max_length = int(max_length or trained_length or
                               run.get("model", {}).get("max_position_embeddings") or 2048)
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.generator = Generator(self.model, self.vocab_size, num_loops=self.num_loops,
                                   kv_policy=kv_policy, eod=self.tokenizer_.eod, exit_rule=rule)

    # --- tokens ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return list(self.tokenizer_.tokenize(string))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer_.detokenize(list(tokens))

    # --- scoring --------------------------------------------------------------------------------
    def _score_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Teacher-forced log-probs [n, s, V] of right-padded rows (causal attention: the padding
        after a row's tokens does not change them)."""
        from megaloop.device import current_device
        from megaloop.inference.early_exit import exit_log_probs

        device = current_device()
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        ids = ids.to(device)
        pos = torch.arange(width, device=device).expand_as(ids)
        logp, _ = exit_log_probs(self.model, ids, pos, self.num_loops, self.rule,
                                 self.vocab_size)
        return logp.cpu()

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probs, whether greedy decoding gives it) per request;
        a too-long request keeps its last max_length + 1 tokens."""
        self.model.eval()
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress,
                   desc="megaloop log-likelihoods")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            rows, spans = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError("lm-eval sent an empty continuation")
                whole = (list(context) + list(continuation))[-(self.max_length + 1):]
                rows.append(whole[:-1])
                spans.append((len(whole) - 1 - len(continuation), whole[-len(continuation):]))
            logp = self._score_rows(rows)
            for row, (i, (first, target)) in enumerate(zip(chunk, spans)):
                lp = logp[row, first:first + len(target)]
                target_t = torch.tensor(target)
                total = lp.gather(-1, target_t.unsqueeze(-1)).sum().item()
                greedy = bool((lp.argmax(-1) == target_t).all())
                results[i] = (total, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(chunk))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood over disjoint windows of max_length tokens (lm-eval's
        rolling windows, each conditioned on the window before; the first on EOD)."""
        from lm_eval import utils

        out = []
        for (string,) in tqdm([r.args for r in requests],
                              disable=disable_tqdm or not self.progress,
                              desc="megaloop rolling log-likelihoods"):
            windows = [(None,) + w for w in map(utils.make_disjoint_window,
                                                 utils.get_rolling_token_windows(
                                                     token_list=self.tok_encode(string),
                                                     prefix_token=self.prefix_token_id,
                                                     max_seq_len=self.max_length,
                                                     context_len=1))]
            total = sum(x[0] for x in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # --- generation -----------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample/temperature) continuations cut at the first
        ``until`` string; the prompt keeps its last max_length - max_gen_toks tokens."""
        from megaloop.inference.generate import SamplingParams, continuation_text

        out = []
        for context, kwargs in tqdm([r.args for r in requests],
                                    disable=disable_tqdm or not self.progress,
                                    desc="megaloop generation"):
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not kwargs.pop("do_sample", False):
                temperature = 0.0
            ids = self.tok_encode(context)[-max(self.max_length - max_new, 1):] or \
                [self.eot_token_id]
            generated = self.generator.generate(
                [ids], max_new, SamplingParams(temperature=temperature,
                                               seed=int(kwargs.pop("seed", 0))))[0]
            if generated and generated[-1] == self.eot_token_id:
                generated = generated[:-1]
            # The text after the context, as tools/serve.py returns it (lm-eval's
            # local-completions route gets the same string).
            text = continuation_text(self.tokenizer_, ids, generated)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, {"until": until}), text)
            out.append(text)
        return out

