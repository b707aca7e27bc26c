"""train_rl.py's configuration: every pretraining flag that still means something in RL (model,
loop, parallelism, optimizer and LR schedule, logging, checkpoints, tokenizer), plus ``RLConfig``.

Left out of the command line, because RL has no dataset and derives its batch from the rollouts:
the data section (prompts come from the environment), --global-batch-size (= --prompts-per-step x
--group-size completions), --seq-length (each step's batch is as wide as its longest rollout),
--train-samples and --rampup-batch-size (a step is one policy update), the validation flags, random
depth and truncated backpropagation (rollouts and updates run at one depth, --rl-num-loops), and
the pretraining loss diagnostics (loss spikes, per-step gradient norms, loop geometry).
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from megaloop.arguments import (ArgumentParser, FlagCheck, add_dataclass_args,
                                add_refused_flags, dataclass_from_args)
from megaloop.data.config import DataConfig
from megaloop.training.run_config import REFUSED_MEGATRON_FLAGS, SECTIONS, RunConfig

# Fields of the pretraining sections that train_rl.py does not take (see the module docstring).
NOT_IN_RL = {
    "training": ("global_batch_size", "seq_length", "train_samples", "rampup_batch_size",
                 "eval_interval", "eval_iters"),
    "loop": ("random_depth_mean", "random_depth_sigma", "random_depth_max",
             "truncated_backprop_steps", "loopformer_objective"),
    "logging": ("log_grad_norm_per_step", "log_loop_geometry", "loss_spike_threshold",
                "loss_spike_window", "p0_collapse_threshold", "p0_collapse_iters"),
}


@dataclass
class RLConfig:
    """Reinforcement learning: environment, rollouts, objective (GRPO or RLTT)."""

    env: str = "demo-tasks"
    """Environment: a shipped one (demo-tasks, gsm8k, countdown; megaloop/rl/environments.py)
    or FILE.py:CLASS, an Environment subclass of your own."""

    env_path: Optional[str] = None
    """The environment's problem file (demo-tasks: a make_demo_corpus.py --tasks-output JSONL;
    gsm8k: GSM8K-style JSONL); passed to it as ``path``."""

    env_limit: Optional[int] = None
    """Read only the first N problems (passed as ``limit``; default: all)."""

    env_args: list[str] = field(default_factory=list)
    """More KEY=VALUE arguments of the environment class (a Python literal, else a string),
    e.g. countdown's size=500 count=4 max_number=10 seed=1."""

    reward_timeout: float = 60.0
    """Seconds one reward() call may take; past it the run stops with one line naming the
    environment and the prompt (exit 2). The shipped rewards take microseconds and a user's
    checker (a symbolic comparison, a small test run) seconds, so a minute stops only a reward
    that hangs; it must stay below the collectives' timeout (--distributed-timeout-minutes),
    which the other ranks would otherwise hit while they wait for this one's rewards."""

    prompts_per_step: int = 32
    """Prompts (groups) per RL step, drawn without replacement from the environment's prompt
    set, seeded by (--seed, step); split evenly over the data-parallel ranks."""

    group_size: int = 8
    """Completions sampled per prompt (G); the advantage is each reward standardised within its
    group."""

    temperature: float = 0.9
    """Sampling temperature of the rollouts; the log-probs the objective scores are taken at the
    same temperature."""

    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1: the whole distribution)."""

    max_new_tokens: int = 16
    """Tokens a completion may write (it stops earlier at the end-of-document token)."""

    objective: Literal["grpo", "rltt"] = "grpo"
    """`grpo`: the clipped-ratio GRPO loss on the last loop step's log-prob of each sampled
    token; `rltt`: the same loss on sum_t w_t log P^(t) over the loop steps ("Prioritize the
    Process, Not Just the Outcome"), w from --loop-weighting."""

    loop_weighting: Optional[Literal["uniform", "progressive", "exit_pdf", "last"]] = None
    """--objective rltt: the loop weights w_t: `uniform` (1/T), `progressive` (t^alpha
    normalised), `exit_pdf` (the sampling policy's own exit distribution per token, detached;
    needs an exit gate) or `last` ((0, ..., 0, 1): GRPO). Default: exit_pdf with a gate, else
    uniform."""

    loop_weighting_alpha: Optional[float] = None
    """--loop-weighting progressive: the exponent alpha (default 1)."""

    clip_eps: float = 0.2
    """The ratio's clip range [1 - eps, 1 + eps]."""

    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (the weights the RL run started
    from, frozen) in the loss. The KL is logged whatever its weight."""

    aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    """How per-token losses become the step's loss: `token-mean` over every response token of
    the global batch, or `sequence-mean` (each completion's mean, then the mean over
    completions)."""

    rl_num_loops: Optional[int] = None
    """Loop count T of the rollouts and the updates (default: --num-loops)."""

    solve_threshold: float = 1.0
    """A completion counts as solved (the log's solve rate) when its reward is at least this."""

    rollout_exit: Optional[str] = None
    """Early exit in the rollouts (q:<q>, kl:<eps>, fixed:<steps>, as --exit of
    tools/generate.py): each sampled token leaves the loop at the rule's step. The objective
    still scores the tokens at --rl-num-loops (its old policy is full depth), so the rollouts
    are off-policy by the gap between the two; --rollout-log records each token's exit depth
    and sampling log-prob to measure it. Default: every token runs all steps."""

    rollout_log: Optional[str] = None
    """Write every completion here, one JSON line each (step, prompt, answer, completion,
    reward, token ids, prompt length, and per completion token the loop steps it ran and its
    log-prob under the sampling distribution, and the weight version: the iteration whose
    weights sampled it), rank 0 only: the batch a step trained on, for reading and for
    recomputing its loss."""

    def env_kwargs(self) -> dict:
        """The keyword arguments the environment class is built with."""
        kwargs = {}
        if self.env_path is not None:
            kwargs["path"] = self.env_path
        if self.env_limit is not None:
            kwargs["limit"] = self.env_limit
        for item in self.env_args:
            key, sep, value = item.partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(f"--env-args {item}: expected KEY=VALUE (e.g. size=500)")
            try:
                kwargs[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                kwargs[key] = value
        return kwargs

    def weighting(self, gated: bool) -> Optional[str]:
        """The loop weighting --objective rltt uses (None for grpo)."""
        if self.objective != "rltt":
            return None
        return self.loop_weighting or ("exit_pdf" if gated else "uniform")

    def validate(self, num_loops: int, gated: bool, dp_size: int, micro_batch_size: int) -> None:
        """Every check of the RL flags alone; ``num_loops``, ``gated``: the model's loop count
        and whether it has an exit gate."""
        for flag, value, low in (("--prompts-per-step", self.prompts_per_step, 1),
                                 ("--group-size", self.group_size, 1),
                                 ("--max-new-tokens", self.max_new_tokens, 1),
                                 ("--env-limit", self.env_limit, 1),
                                 ("--rl-num-loops", self.rl_num_loops, 1)):
            if value is not None and value < low:
                raise ValueError(f"{flag} {value} must be >= {low}")
        if self.group_size == 1:  # both objectives are GRPO's: A = (r - mean) / std in a group
            raise ValueError(f"--group-size 1: --objective {self.objective} standardises each "
                             f"reward within its group, so one completion per prompt has "
                             f"advantage 0 and nothing trains; use --group-size 2 or more "
                             f"(GRPO and RLTT use 8)")
        if self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature} must be > 0 (RL samples; the "
                             f"objective scores the sampled tokens at this temperature)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1]")
        if not 0 <= self.clip_eps < 1:
            raise ValueError(f"--clip-eps {self.clip_eps} must be in [0, 1)")
        if self.kl_beta < 0:
            raise ValueError(f"--kl-beta {self.kl_beta} must be >= 0")
        if self.objective != "rltt" and self.loop_weighting is not None:
            raise ValueError(f"--loop-weighting {self.loop_weighting} weighs RLTT's loop steps: "
                             f"add --objective rltt, or drop it (GRPO reads the last step)")
        weighting = self.weighting(gated)
        if self.loop_weighting_alpha is not None and weighting != "progressive":
            raise ValueError(f"--loop-weighting-alpha is the exponent of --loop-weighting "
                             f"progressive: add that, or drop --loop-weighting-alpha")
        if weighting == "exit_pdf" and not gated:
            raise ValueError("--loop-weighting exit_pdf reads the exit gate's distribution; this "
                             f"model has none (--num-loops {num_loops}, or --exit-loss last): use "
                             f"uniform or progressive")
        if self.rl_num_loops is not None and weighting == "exit_pdf" \
                and self.rl_num_loops != num_loops:
            raise ValueError(f"--rl-num-loops {self.rl_num_loops} with --loop-weighting "
                             f"exit_pdf: the exit distribution is the gate's over the trained "
                             f"--num-loops {num_loops} steps; use --rl-num-loops {num_loops} or "
                             f"another weighting")
        if self.prompts_per_step % dp_size:
            raise ValueError(f"--prompts-per-step {self.prompts_per_step} must be a multiple of "
                             f"the data-parallel size {dp_size} (each rank rolls out its share "
                             f"of the groups)")
        local = self.prompts_per_step // dp_size * self.group_size
        if local % micro_batch_size:
            raise ValueError(f"{local} completions per data-parallel rank (--prompts-per-step x "
                             f"--group-size / data-parallel size) are not a multiple of "
                             f"--micro-batch-size {micro_batch_size}; choose a divisor")
        if self.rollout_exit is not None:
            from megaloop.model.exit_rules import parse_exit  # (torch: not at --help)

            try:
                parse_exit(self.rollout_exit)
            except ValueError as error:
                raise ValueError(str(error).replace("--exit", "--rollout-exit", 1)) from None
        if self.solve_threshold != self.solve_threshold:  # NaN
            raise ValueError("--solve-threshold must be a number")
        if not 0 < self.reward_timeout < float("inf"):  # NaN fails too
            raise ValueError(f"--reward-timeout {self.reward_timeout} must be a number of "
                             f"seconds > 0")


@dataclass
class RLRunConfig(RunConfig):
    rl: RLConfig = field(default_factory=RLConfig)

    def check_flags(self, world_size: int | None = None) -> None:
        """RunConfig.check_flags, and what RL does not support, all refusals at once (pure
        Python: train_rl.py runs it before torch and megatron-core load)."""
        par, loop = self.parallel, self.loop
        flags = FlagCheck()
        with flags.check():
            super().check_flags(world_size)
        for flag, value in (("--pipeline-model-parallel-size",
                             par.pipeline_model_parallel_size),
                            ("--context-parallel-size", par.context_parallel_size)):
            with flags.check():
                if value > 1:
                    raise ValueError(f"{flag} {value}: train_rl.py's rollouts run megaloop's "
                                     f"Generator, which needs one pipeline stage and no context "
                                     f"parallelism; use {flag} 1")
        for flag, on in (("--sequence-parallel", par.sequence_parallel),
                         ("--overlap-param-gather", par.overlap_param_gather)):
            with flags.check():
                if on:
                    raise ValueError(f"{flag} is not supported by train_rl.py (its rollouts and "
                                     f"log-probs call the model directly, outside DDP's "
                                     f"forward); drop it")
        dropouts = [(flag, p) for flag, p in (("--hidden-dropout", self.model.hidden_dropout),
                                              ("--attention-dropout",
                                               self.model.attention_dropout)) if p]
        with flags.check():
            if dropouts:
                given = " and ".join(f"{flag} {p}" for flag, p in dropouts)
                raise ValueError(f"{given}: RL scores the sampled tokens under the policy that "
                                 f"sampled them (no dropout); a dropout mask in the update would "
                                 f"score another policy and move the ratio off 1 (clipped for no "
                                 f"reason). Pass --hidden-dropout 0 --attention-dropout 0 "
                                 f"(Megatron-LM's defaults are 0.1)")
        with flags.check():
            if self.model.fp8_format is not None:
                raise ValueError(f"--fp8-format {self.model.fp8_format}: train_rl.py's rollouts "
                                 f"decode one token per row and its updates score micro-batches "
                                 f"as wide as their longest completion, while Transformer "
                                 f"Engine's FP8 GEMMs need those token counts to be multiples of "
                                 f"8/16; drop --fp8-format (RL runs in --bf16)")
        with flags.check():
            if loop.exit_loss == "adaptive-gate":
                raise ValueError("--exit-loss adaptive-gate trains only the exit gate: not an RL "
                                 "objective; use the checkpoint's --exit-loss")
        flags.raise_any()

    def validate(self, world_size: int | None = None) -> None:
        """The pretraining checks that apply (the data section's do not: RL reads no dataset),
        then the RL flags and what RL does not support yet."""
        par, loop = self.parallel, self.loop
        self.check_flags(world_size)
        dp = self.parallel.data_parallel_size(world_size)
        self.rl.validate(loop.num_loops, loop.gated, dp, self.training.micro_batch_size)
        collective_s = par.distributed_timeout_minutes * 60
        if self.rl.reward_timeout >= collective_s:
            # The rank whose reward hangs reaches the step's gather of reward errors only at the
            # timeout; the others wait there, and must not hit the collectives' own timeout.
            raise ValueError(f"--reward-timeout {self.rl.reward_timeout:g} s must be below "
                             f"--distributed-timeout-minutes {par.distributed_timeout_minutes} "
                             f"({collective_s} s), which the other ranks would reach first "
                             f"while they wait for a hanging reward; lower it or raise "
                             f"--distributed-timeout-minutes")
        if self.rl.rollout_exit is not None:
            from megaloop.model.exit_rules import parse_exit

            reason = loop.supports(depth=self.rl.rl_num_loops or loop.num_loops,
                                   exit=parse_exit(self.rl.rollout_exit), kv_policy="full")
            if reason:
                raise ValueError(f"--rollout-exit {self.rl.rollout_exit}: {reason}")
        tr = self.training
        tr.global_batch_size = self.rl.prompts_per_step * self.rl.group_size
        tr.seq_length = self.model.max_position_embeddings  # an upper bound; see the docstring
        tr.eval_iters = 0
        data, self.data = self.data, _NoDataset(**dataclasses.asdict(self.data))
        try:
            super().validate(world_size)
        finally:
            self.data = data


@dataclass
class _NoDataset(DataConfig):
    """The data section while RunConfig.validate runs: RL reads no dataset (its prompts come
    from the environment, which megaloop/rl/train.py checks), so the data checks are skipped."""

    def validate(self, eval_iters: int = 0) -> None:
        return None


RL_SECTIONS = {**SECTIONS, "rl": RLConfig}
# Defaults that differ from pretraining's: an RL step is long and its telemetry is the point.
RL_DEFAULTS = {"logging": {"log_interval": 1}}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="train_rl.py",
        description="Reinforcement learning (GRPO, RLTT) of a looped language model on "
                    "megatron-core: rollouts from megaloop's generator, rewards from an "
                    "environment, updates through the pretraining trainer.",
        allow_abbrev=False)
    for name, cls in RL_SECTIONS.items():
        if name == "data":
            continue
        left_out = NOT_IN_RL.get(name, ())
        only = tuple(f.name for f in dataclasses.fields(cls) if f.name not in left_out)
        add_dataclass_args(parser, cls, only=only if left_out else (),
                           defaults=RL_DEFAULTS.get(name))
    add_refused_flags(parser, "Megatron-LM flags megaloop refuses", REFUSED_MEGATRON_FLAGS)
    return parser


def parse_args(argv=None) -> RLRunConfig:
    namespace = build_parser().parse_args(argv)
    sections = {name: dataclass_from_args(cls, namespace) for name, cls in RL_SECTIONS.items()}
    return RLRunConfig(**sections)
