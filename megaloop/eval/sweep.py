"""Depth sweep: a trained looped model scored at several inference depths.

At each depth k the held-out batches run k loop steps (the model reads out every step) and give:

- the LM loss at every step 1..k and its perplexity, through the trainer's own statistics
  (megaloop.model.loss: token-weighted means over all scored tokens), so the numbers at the
  training depth are the trainer's validation losses for the same samples;
- the exit distribution p_1..p_k of a k-step run and the expected exit step sum_t t p_t;
- per early-exit rule (megaloop.inference.early_exit): the loss of every token at its exit step
  and the mean executed depth;
- the recurrence's geometry per step (megaloop.model.instruments.LoopGeometry: angular distance
  and relative update norm between a step's input and output, state variance relative to step
  k), as in "What Makes Recurrence Effective in Looped Language Models?" section 3.

Depths are labelled against the training horizon T: under-unrolling (k < T), training horizon
(k = T), extrapolation (k > T).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

REGIMES = ("under-unrolling", "training horizon", "extrapolation")


def regime(depth: int, trained: int) -> str:
    return REGIMES[0] if depth < trained else REGIMES[1] if depth == trained else REGIMES[2]


@dataclass
class DepthResult:
    """Everything measured at one inference depth."""

    depth: int
    regime: str
    loss: float
    """LM loss at the last step (step ``depth``)."""
    perplexity: float
    step_losses: list[float]
    """LM loss at each step 1..depth."""
    exit_probs: Optional[list[float]]
    """Mean exit distribution p_t over the scored tokens (None: the model has no gate)."""
    expected_exit_step: Optional[float]
    objective: float
    """The training objective's value at this depth (the exit loss, or the LM loss)."""
    rules: dict = field(default_factory=dict)
    """Exit rule -> {"loss", "perplexity", "mean_depth"}."""
    geometry: dict = field(default_factory=dict)
    """angular_distance / relative_update_norm / state_variance, one value per step."""
    tokens: int = 0
    tasks: dict = field(default_factory=dict)
    """Held-out problem accuracy (megaloop.eval.tasks.accuracy): overall, by family and k."""


def default_rules(model) -> list[str]:
    """q-exits when the model has a gate, and Huginn's KL rule."""
    return (["q:0.5", "q:0.9"] if model.exit_gate is not None else []) + ["kl:0.01"]


def _spell(name: str) -> str:
    """tools/evaluate.py's flags: the rules are --exit-rules."""
    return "--exit-rules" if name == "exit" else "--" + name.replace("_", "-")


def check_depths(model, depths: list[int]) -> None:
    """ValueError for a depth the model cannot run (``LoopConfig.supports``)."""
    for k in depths:
        reason = model.loop.supports(depth=k)
        if reason:
            raise ValueError(reason)


def _forward_stats(model, batches, depth: int, done: Callable[[], None]) -> dict:
    """The trainer's reduced statistics of ``batches`` at ``depth`` steps, every step read out;
    ``done()`` after each batch."""
    from megaloop.model import recurrence
    from megaloop.model.loss import loss_func, reduce_stats

    reports = []
    for b in batches:
        ctx = recurrence.context(model, b["tokens"], b.get("attention_mask"), b["labels"], depth,
                                 read_every_step=True)
        out = recurrence.fold(model, recurrence.begin(model, b["tokens"], b["position_ids"], ctx),
                              ctx)
        reports.append(loss_func(b["loss_mask"], depth, out)[2])
        done()
    return reduce_stats(reports, depth)


def _rule_stats(model, batches, depth: int, rule, done: Callable[[], None]) -> dict:
    from megaloop.inference.early_exit import score

    loss_sum = depth_sum = tokens = 0.0
    for b in batches:
        loss, steps = score(model, b["tokens"], b["position_ids"], b["labels"], depth, rule,
                            attention_mask=b.get("attention_mask"))
        mask = b["loss_mask"].float()
        loss_sum += (loss.double() * mask).sum().item()
        depth_sum += (steps.double() * mask).sum().item()
        tokens += mask.sum().item()
        done()
    tokens = max(tokens, 1.0)
    mean = loss_sum / tokens
    return {"loss": mean, "perplexity": math.exp(min(mean, 700)),
            "mean_depth": depth_sum / tokens}


def work_count(batches: list, depths: list[int], rules: list[str]) -> int:
    """Batch passes of a sweep: at every depth one forward of each batch, and one more per exit
    rule (``sweep``'s ``bar`` advances by one after each)."""
    return len(depths) * len(batches) * (1 + len(rules))


@torch.no_grad()
def sweep(model, batches: list[dict], depths: list[int], rules: list[str],
          progress: Optional[Callable[[str], None]] = None,
          tasks: Optional[tuple] = None, bar=None) -> list[DepthResult]:
    """Score ``batches`` at every depth of ``depths`` (ascending), under every exit rule;
    ``tasks``: (items, encoded, vocab_size) of held-out problems scored at every depth too;
    ``bar``: a tqdm bar of ``work_count`` batch passes, advanced after each (a deep sweep of the
    demo takes minutes, and one depth of it may too)."""
    from megaloop.eval.tasks import accuracy
    from megaloop.inference.early_exit import parse_exit
    from megaloop.model.instruments import LoopGeometry

    model.eval()
    check_depths(model, depths)
    parsed = {text: parse_exit(text) for text in rules}
    for rule in parsed.values():
        reason = model.loop.supports(exit=rule, spell=_spell)
        if reason:
            raise ValueError(reason)
    trained = model.loop.num_loops
    results = []

    def done() -> None:
        if bar is not None:
            bar.update(1)

    for depth in depths:
        if bar is not None:
            bar.set_postfix_str(f"depth {depth}", refresh=False)
        geometry = LoopGeometry(model, depth)
        geometry.start()
        try:
            stats = _forward_stats(model, batches, depth, done)
        finally:
            geo = geometry.finish() or {}
        probs = stats["exit_probs"] if depth > 1 else [1.0] if model.exit_gate else None
        loss = stats["step_losses"][-1]
        result = DepthResult(
            depth=depth, regime=regime(depth, trained), loss=loss,
            perplexity=math.exp(min(loss, 700)), step_losses=stats["step_losses"],
            exit_probs=probs,
            expected_exit_step=None if probs is None else sum(
                (t + 1) * p for t, p in enumerate(probs)),
            objective=stats["loss"], geometry=geo, tokens=stats["tokens"])
        for text, rule in parsed.items():
            result.rules[text] = _rule_stats(model, batches, depth, rule, done)
        if tasks is not None:
            items, encoded, vocab_size = tasks
            result.tasks = accuracy(model, encoded, items, depth, vocab_size)
        results.append(result)
        if progress is not None:
            extra = f", task accuracy {result.tasks['overall']:.3f}" if result.tasks else ""
            progress(f"depth {depth:>3} ({result.regime}): loss {loss:.4f}{extra}")
    return results


def as_json(results: list[DepthResult], meta: dict) -> dict:
    return {**meta, "depths": [asdict(r) for r in results]}
