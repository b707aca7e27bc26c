"""Per-step RL telemetry, the quantities "Closing the Loop" (arXiv 2610.00673) Appendix C reads
to tell early whether RL moves the policy: reward mean, solve rate (RL helps only when it is
neither too low nor too high), the fraction of groups whose rewards are all equal (they carry
no learning signal), KL to the reference and the gradient norm (both near zero: the policy does
not move), the response length, and the mean log-prob of the sampled tokens at every loop step.

``step_record`` returns one record in the trainer's ``--log-jsonl`` format (an integer
``iteration``, ``split`` "train"), so megaloop.training.metrics.MetricsLogger writes it like any
training record (stdout line, JSONL, TensorBoard, W&B) and megaloop.eval.run_plot reads it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megaloop.rl.objectives import k3_kl


def step_record(iteration: int, rewards: torch.Tensor, mask: torch.Tensor,
                step_logp: torch.Tensor, logp: Optional[torch.Tensor] = None,
                ref_logp: Optional[torch.Tensor] = None, solve_threshold: float = 1.0,
                **extra) -> dict:
    """The telemetry of one RL step.

    ``rewards`` [groups, G] (completion b = group * G + i in the other tensors); ``mask`` [B, S]
    1 on response tokens; ``step_logp`` [T, B, S] the sampled tokens' log-probs per loop step;
    ``logp`` / ``ref_logp`` [B, S] the policy's and the reference's (the KL is their k3 mean over
    response tokens; left out without ``ref_logp``). A completion is solved when its reward is at
    least ``solve_threshold``. ``extra`` (e.g. ``grad_norm``, ``lr``, ``loss``) is copied in."""
    rewards = rewards.detach().double()
    mask = mask.detach().double()
    tokens = mask.sum().clamp(min=1)
    uniform = (rewards.amax(1) == rewards.amin(1)).double()
    record = {
        "iteration": int(iteration), "split": "train",
        "reward_mean": float(rewards.mean()),
        "solve_rate": float((rewards >= solve_threshold).double().mean()),
        "uniform_reward_groups": float(uniform.mean()),
        "response_length": float(mask.sum(1).mean()),
        "step_log_probs": [float((lp.detach().double() * mask).sum() / tokens)
                           for lp in step_logp],
    }
    if ref_logp is not None:
        if logp is None:
            raise ValueError("the KL to the reference needs logp (the policy's log-probs) too")
        kl = k3_kl(logp.detach().double(), ref_logp.detach().double())
        record["kl"] = float((kl * mask).sum() / tokens)
    for key, value in extra.items():
        record[key] = float(value) if isinstance(value, (int, float, torch.Tensor)) else value
    return record


def format_line(r: dict) -> str:
    """One log line of a record of ``step_record``."""
    steps = " ".join(f"{v:.3f}" for v in r["step_log_probs"])
    kl = f" | kl {r['kl']:.2e}" if "kl" in r else ""
    grad = f" | grad norm {r['grad_norm']:.4f}" if "grad_norm" in r else ""
    return (f" rl step {r['iteration']:6d} | reward {r['reward_mean']:.3f} | solve rate "
            f"{r['solve_rate']:.3f} | uniform groups {r['uniform_reward_groups']:.3f}{kl}"
            f" | response length {r['response_length']:.1f} | step log-probs [{steps}]{grad}")


def write_rollouts(path: str, step: int, rows: list) -> None:
    """Append one JSON line per completion to ``path`` (--rollout-log; rank 0 calls it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}) + "\n")
