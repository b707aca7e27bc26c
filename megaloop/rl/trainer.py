"""RLTrainer: the pretraining Trainer with an RL step in place of a data step (the step, the
reference policy and resume are described in megaloop/rl/train.py, which imports this module
only once the flags are checked; this module imports nothing of it)."""

from __future__ import annotations

import os
import re
import time
from functools import partial

import torch
from megatron.core import parallel_state

from megaloop.checkpoint.errors import CheckpointError, CheckpointMismatch
from megaloop.checkpoint.format import unwrap
from megaloop.device import current_device
from megaloop.inference.generate import Generator, SamplingParams
from megaloop.model.exit_rules import parse_exit
from megaloop.model.looped_gpt import build_model
from megaloop.rl.environments import checked_prompts, load_environment
from megaloop.rl.logprobs import step_log_probs
from megaloop.rl.objectives import (aggregate_parts, group_advantages, grpo_per_token,
                                    loop_weights, rltt_log_probs)
from megaloop.rl.rollouts import RewardError, prompt_indices, rollout, sampling_seed
from megaloop.rl.telemetry import format_line, step_record, write_rollouts
from megaloop.training import checkpointing
from megaloop.training.trainer import Trainer

# The statistics one micro-batch reports (summed over micro-batches and data-parallel ranks).
STATS = ("numerator", "denominator", "kl", "clipped", "tokens")


def _loss_func(denominator, kl, clipped, mask, numerator):
    """megatron-core's loss_func contract with calculate_per_token_loss: (the micro-batch's
    part of the loss, the count finalize_model_grads divides the gradients by, the report)."""
    mask = mask.to(numerator.dtype)
    kl_sum = (kl * mask).sum() if kl is not None else torch.zeros_like(numerator)
    report = torch.stack([numerator.detach(), denominator.to(numerator.dtype), kl_sum,
                          (clipped * mask).sum(), mask.sum()]).float()
    return numerator, denominator.detach().to(torch.int), {"rl": report}


class RLTrainer(Trainer):
    """GRPO / RLTT policy updates from rollouts of the policy itself (megaloop/rl/train.py)."""

    def __init__(self, cfg, startup=None):
        self.rl = cfg.rl
        self.num_loops = cfg.rl.rl_num_loops or cfg.loop.num_loops
        self.weighting = cfg.rl.weighting(cfg.loop.gated)
        self.reference = self.reference_source = None
        super().__init__(cfg, startup)
        self.local_groups = self.rl.prompts_per_step // self.dp_size

    # --- start-up: the reference policy and the prompt set ------------------------------------
    def _load(self):
        cfg = self.cfg
        policy = unwrap(self.model)
        reference = build_model(cfg.model, cfg.loop, self.tokenizer.vocab_size,
                                tp_size=cfg.parallel.tensor_model_parallel_size,
                                bf16=cfg.training.bf16)
        # Built at every --kl-beta, 0 included: the logged KL says whether RL moves the policy
        # (Megatron-RL also scores its reference whatever the KL weight). On the device, as
        # build_training_model moves the policy: left on the host, it would meet the GPU's
        # tokens in its embedding at the first _score.
        reference.cuda(current_device())
        if cfg.training.bf16:
            # Wrapped as build_training_model wraps the policy: Float16Module casts every
            # weight to bf16, the local layers' norm weights included, which build_model's
            # bf16 leaves fp32. Otherwise the reference would hold fp32 norm weights (full
            # precision when read from a checkpoint, and scored by another kernel), and its
            # log-probs would not be the policy's at step 1.
            from megatron.core.transformer.module import Float16Module

            reference = Float16Module(reference.config, reference)
        self.reference = reference
        self.reference.load_state_dict(policy.state_dict())  # the seeded initialisation
        self.reference.requires_grad_(False)
        self.reference.eval()
        info = super()._load()
        if info is None:
            self.reference_source = {"kind": "init", "seed": cfg.training.seed}
        elif not cfg.checkpoint.finetune and "rl_reference" in info["extra"]:
            self.reference_source = info["extra"]["rl_reference"]
            self._load_reference(self.reference_source)
        else:  # RL starts here from these weights: they are the reference
            self.reference.load_state_dict(policy.state_dict())
            self.reference_source = {"kind": "checkpoint", "path": os.path.abspath(info["path"])}
        self.logger.print(f"> reference policy: {describe_source(self.reference_source)}")
        return info

    def _load_reference(self, source: dict) -> None:
        if source["kind"] == "init":
            if source["seed"] != self.cfg.training.seed:
                raise CheckpointMismatch(
                    f"the RL run in --load {self.cfg.checkpoint.load} started from the weights "
                    f"initialised with --seed {source['seed']}, its reference policy; this run "
                    f"has --seed {self.cfg.training.seed}: pass --seed {source['seed']}")
            return  # the reference holds this seed's initialisation already
        path = source["path"]
        match = re.search(r"iter_(\d+)$", path.rstrip("/"))
        if not os.path.isdir(path) or match is None:
            raise CheckpointError(f"the reference policy of the RL run in --load "
                                  f"{self.cfg.checkpoint.load} is the checkpoint {path}, which "
                                  f"is gone; put it back (the KL to it is the run's reference)")
        checkpointing.load_checkpoint(os.path.dirname(path.rstrip("/")), self.reference,
                                      iteration=int(match.group(1)), load_optim=False,
                                      load_rng=False, finetune=True,
                                      verify=self.cfg.checkpoint.ckpt_checksums)

    def _build_data(self):
        self.env = load_environment(self.rl.env, **self.rl.env_kwargs())
        self.prompt_set = checked_prompts(self.env, self.rl.env)
        self.train_dataset = self.train_iter = self.valid_iter = None

    def checkpoint_extra(self) -> dict:
        return {**super().checkpoint_extra(), "rl_reference": self.reference_source}

    def describe(self) -> None:
        super().describe()
        rl = self.rl
        objective = rl.objective if self.weighting is None else \
            f"rltt ({self.weighting} loop weights)"
        self.logger.print(
            f"> RL: --env {rl.env} ({len(self.prompt_set)} prompts) | {rl.prompts_per_step} "
            f"prompts x {rl.group_size} completions per step | T = {self.num_loops} | "
            f"objective {objective}, {rl.aggregation}, clip {rl.clip_eps}, KL beta "
            f"{rl.kl_beta} | temperature {rl.temperature}, top-p {rl.top_p}, at most "
            f"{rl.max_new_tokens} new tokens")

    # --- one RL step ---------------------------------------------------------------------------
    def _rollouts(self, step: int):
        """This data-parallel rank's share of the step's groups, rolled out by the policy."""
        rl, seed = self.rl, self.cfg.training.seed
        chosen = prompt_indices(seed, step, rl.prompts_per_step, len(self.prompt_set))
        mine = chosen[self.dp_rank * self.local_groups:(self.dp_rank + 1) * self.local_groups]
        generator = Generator(unwrap(self.model), self.tokenizer.vocab_size,
                              num_loops=self.num_loops, eod=self.tokenizer.eod,
                              exit_rule=parse_exit(rl.rollout_exit))
        params = SamplingParams(temperature=rl.temperature, top_p=rl.top_p,
                                seed=sampling_seed(seed, step, self.dp_rank))
        error = None
        try:
            r = rollout(generator, self.tokenizer, self.env, [self.prompt_set[i] for i in mine],
                        rl.group_size, rl.max_new_tokens, params, env_name=rl.env,
                        indices=mine, weight_version=self.iteration,
                        reward_timeout=rl.reward_timeout)
        except RewardError as exc:
            r, error = None, str(exc)
        # A bad reward shows on the data-parallel rank that drew its prompt: every rank learns
        # of it here and raises the same error, so none waits in a collective for the others.
        # A reward that hangs is stopped on its rank by --reward-timeout (validated below the
        # collectives' timeout): that rank arrives here late, with its RewardError, and the
        # others, waiting here, leave with it.
        errors = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise RewardError(first)
        return r

    def _weighted(self, step_logp: torch.Tensor, weights) -> torch.Tensor:
        """The log-prob the objective scores: the last step's (GRPO), or RLTT's weighted sum."""
        if self.weighting is None:
            return step_logp[-1]
        return rltt_log_probs(step_logp, weights)

    @torch.no_grad()
    def _score(self, r):
        """Micro-batches of the rollouts with the sampling ("old") policy's and the reference's
        log-probs, the loop weights and the advantages; and per micro-batch the per-step
        log-probs [T, b, S] and exit distribution (None without a gate) of the sampling policy."""
        policy, rl = unwrap(self.model), self.rl
        policy.eval()  # no dropout: the log-probs of the policy that sampled
        advantages = group_advantages(r.rewards).flatten()
        mbs = self.cfg.training.micro_batch_size
        batches, steps = [], []
        vocab = self.tokenizer.vocab_size
        for b0 in range(0, r.tokens.size(0), mbs):
            mask = r.response_mask[b0:b0 + mbs]
            width = int(mask.sum(0).nonzero().max()) + 2  # through the last completion token
            tokens = r.tokens[b0:b0 + mbs, :width].to(current_device())
            mask = mask[:, :width - 1].to(current_device())
            old_steps, exit_probs = step_log_probs(policy, tokens, vocab, self.num_loops,
                                                   rl.temperature)
            ref_steps, _ = step_log_probs(unwrap(self.reference), tokens, vocab,
                                          self.num_loops, rl.temperature)
            weights = None
            if self.weighting is not None:
                weights = loop_weights(self.weighting, self.num_loops,
                                       rl.loop_weighting_alpha or 1.0, exit_probs)
                weights = weights.to(current_device())
            batches.append({"tokens": tokens, "mask": mask, "weights": weights,
                            "advantages": advantages[b0:b0 + mbs].to(current_device()),
                            "old": self._weighted(old_steps, weights),
                            "ref": self._weighted(ref_steps, weights)})
            steps.append((old_steps, exit_probs))
        policy.train()
        return batches, steps

    def _forward_step(self, data_iterator, model):
        rl, b = self.rl, next(data_iterator)
        step_logp, _ = step_log_probs(unwrap(model), b["tokens"], self.tokenizer.vocab_size,
                                      self.num_loops, rl.temperature)
        logp = self._weighted(step_logp, b["weights"])
        per_token, kl, clipped = grpo_per_token(logp, b["old"], b["ref"], b["advantages"],
                                                rl.clip_eps, rl.kl_beta)
        numerator, denominator = aggregate_parts(per_token, b["mask"], rl.aggregation)
        return numerator, partial(_loss_func, denominator, kl, clipped, b["mask"])

    def train_step(self):
        step, start = self.iteration + 1, time.time()
        self.step_gbs = self.gbs
        r = self._rollouts(step)
        rollout_s = time.time() - start
        batches, steps = self._score(r)
        self.num_microbatches = len(batches)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter(batches),
            model=[self.model], num_microbatches=len(batches),
            seq_length=max(b["tokens"].size(1) for b in batches),
            micro_batch_size=self.cfg.training.micro_batch_size, forward_only=False)
        self.lr = next(g["lr"] for g in self.optimizer.param_groups if g["default_config"])
        sums = torch.stack([rep["rl"] for rep in reports]).sum(0).to(current_device())
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        totals = dict(zip(STATS, sums.tolist()))
        loss = totals["numerator"] / max(totals["denominator"], 1.0)
        if self.guard.step_is_finite(self.model, loss):
            ok, grad_norm, _ = self.optimizer.step()
        else:
            ok, grad_norm = False, float("nan")
        if ok:
            self.scheduler.step(increment=1)
        else:
            self.skipped += 1
        record = self._telemetry(step, r, batches, steps)
        record.update(loss=loss, clip_fraction=totals["clipped"] / max(totals["tokens"], 1.0),
                      rollout_s=rollout_s, update_s=time.time() - start - rollout_s)
        return record, grad_norm, ok

    def _telemetry(self, step: int, r, batches: list, steps: list) -> dict:
        """The step's telemetry over the whole global batch (every data-parallel rank's
        rollouts gathered), and its rollouts in --rollout-log."""
        width = max(b["mask"].size(1) for b in batches)

        def pad(x):  # [..., S] -> [..., width]
            return torch.nn.functional.pad(x.cpu().double(), (0, width - x.size(-1)))

        mine = {"rewards": r.rewards, "mask": torch.cat([pad(b["mask"]) for b in batches]),
                "steps": torch.cat([pad(s) for s, _ in steps], dim=1),
                "exit": (torch.cat([pad(e) for _, e in steps], dim=1)
                         if steps[0][1] is not None else None),
                "old": torch.cat([pad(b["old"]) for b in batches]),
                "ref": torch.cat([pad(b["ref"]) for b in batches]),
                "rows": self._rollout_rows(r) if self.rl.rollout_log else None}
        everyone = [None] * self.dp_size
        torch.distributed.all_gather_object(everyone, mine,
                                            group=parallel_state.get_data_parallel_group())
        full = max(p["mask"].size(1) for p in everyone)

        def cat(key, dim=0):
            return torch.cat([torch.nn.functional.pad(p[key], (0, full - p[key].size(-1)))
                              for p in everyone], dim=dim)

        record = step_record(step, torch.cat([p["rewards"] for p in everyone]), cat("mask"),
                             cat("steps", dim=1), cat("old"), cat("ref"),
                             solve_threshold=self.rl.solve_threshold)
        if everyone[0]["exit"] is not None:  # the sampling policy's p_t, over response tokens
            mask, exits = cat("mask"), cat("exit", dim=1)
            record["exit_probs"] = [float((e * mask).sum() / mask.sum().clamp(min=1))
                                    for e in exits]
            record["p0"] = record["exit_probs"][0]
        if self.rl.rollout_log and torch.distributed.get_rank() == 0:
            write_rollouts(self.rl.rollout_log, step, [row for p in everyone for row in p["rows"]])
        return record

    def _rollout_rows(self, r) -> list:
        G = self.rl.group_size
        rows = []
        for b, completion in enumerate(r.completions):
            prompt = r.prompts[b // G]
            mask = r.response_mask[b]
            first = int(mask.nonzero().min()) + 1  # the first completion token
            last = int(mask.nonzero().max()) + 1
            rows.append({"prompt": prompt.text, "answer": prompt.answer,
                         "completion": completion, "reward": float(r.rewards[b // G, b % G]),
                         "tokens": r.tokens[b, :last + 1].tolist(), "prompt_length": first,
                         "exit_depths": r.exit_depths[b],
                         "sampling_logprobs": r.sampling_logprobs[b],
                         "weight_version": r.weight_version})
        return rows

    # --- the loop ------------------------------------------------------------------------------
    def _train_loop(self, exits):
        tr, log = self.cfg.training, self.cfg.logging
        self.describe()
        reason = exits.before_training(self.iteration)
        if reason is not None:
            return reason
        while self.iteration < tr.train_iters:
            start = time.time()
            self.hooks.before_step(self.iteration)
            record, grad_norm, applied = self.train_step()
            self.finalize_saves(blocking=False)
            startup = None
            if not self.startup.done:
                startup = self.startup.finish("first step")
                self.logger.print(self.startup.line())
            self.iteration += 1
            self.hooks.after_step(self.iteration)
            self.save_lock.refresh()
            self.consumed_samples += self.gbs
            record.update(train_iters=tr.train_iters, consumed_samples=self.consumed_samples,
                          grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          lr=self.lr, skipped_iters=self.skipped,
                          ms_per_iter=(time.time() - start) * 1000.0)
            if startup is not None:
                record["startup_s"] = startup
            if self.iteration % log.log_interval == 0 or self.iteration == tr.train_iters:
                line = (f"{format_line(record)} | loss {record['loss']:.5f} | lr "
                        f"{self.lr:.3e} | {record['ms_per_iter']:.0f} ms (rollouts "
                        f"{record['rollout_s']:.2f} s)")
                if self.skipped:
                    line += f" | skipped {self.skipped}"
                self.logger.log(record, line=line)
            diverged = self.guard.record(applied, self.iteration)
            if diverged:
                from megaloop.training.exit_conditions import RunError

                raise RunError(f"{diverged}. {self._after_divergence()}")
            self.save_if_due(applied)
            reason = exits.reason(self.iteration)
            if reason is not None:
                return reason
        return None


def describe_source(source: dict) -> str:
    if source["kind"] == "init":
        return f"the initialisation of --seed {source['seed']} (no checkpoint loaded)"
    return f"the weights of {source['path']}, frozen"
