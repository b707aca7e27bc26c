"""train_rl.py's run: rollouts and policy updates on the same ranks, through the pretraining
trainer (megaloop/training/trainer.py): its DDP model, optimizer (distributed or not), gradient
clipping, NaN guard, LR schedule, checkpoints, exit conditions and logger.

One RL step (``RLTrainer.train_step``; ``--train-iters`` of them, one policy update each):

1. prompts: ``--prompts-per-step`` groups drawn without replacement from the environment's
   prompt set by a generator seeded with (--seed, step), the same on every rank; data-parallel
   rank d takes the d-th contiguous share of the groups;
2. rollouts: ``--group-size`` completions of each of its prompts in one batch of megaloop's
   Generator (megaloop/rl/rollouts.py), sampled from a generator seeded with (--seed, step, d):
   every tensor-parallel rank samples the same tokens; the environment rewards each completion;
3. the sampling policy's ("old") and the reference policy's log-probs of the sampled tokens at
   every loop step (megaloop/rl/logprobs.py), without gradient, and the exit distribution of the
   sampling policy (RLTT's exit_pdf weights). With one update per rollout batch the policy's
   log-probs equal the old ones and the ratio is 1; the clip matters once a batch is reused;
4. the update: megatron-core's forward-backward schedule over micro-batches of completions, with
   the loss of megaloop/rl/objectives.py (GRPO, or RLTT's weighted sum over loop steps) summed
   per micro-batch and divided by the global batch's response tokens (token-mean) or completions
   (sequence-mean) in finalize_model_grads, as the pretraining loss is per token; then the
   optimizer step (clipping, NaN guard, LR schedule) as in pretraining;
5. telemetry (megaloop/rl/telemetry.py) over the whole global batch: one log line and one
   --log-jsonl record per step.

The reference policy is the weights the RL run started from, frozen: a second model, built beside
the policy. A checkpoint names where it came from (``rl_reference`` in its counters: the
checkpoint folder loaded at the start, or the seeded initialisation), so ``--load`` of an RL
checkpoint rebuilds it; with the RNG states, the step count and the optimizer, a resumed run
continues exactly as the straight run (tests/test_rl_train.py).

``--load`` of a checkpoint that is not an RL one (pretraining, mid-training, converted) starts
RL from its weights (as --finetune: step 0, a fresh optimizer); ``--load`` of an RL checkpoint
resumes it (add --finetune to start a new RL run from its weights instead).
"""

from __future__ import annotations

import os
import sys
from typing import Optional


def is_rl_checkpoint(load: Optional[str], step: Optional[int]) -> bool:
    """Whether --load holds a checkpoint written by train_rl.py (no process group needed)."""
    from megaloop.checkpoint.format import read_common
    from megaloop.checkpoint.tracker import resolve

    if not load or not os.path.isdir(load):
        return False
    path = resolve(load, step)
    return path is not None and "rl_reference" in (read_common(path).get("extra") or {})


def configure(argv: Optional[list] = None):
    """Flags -> a validated RLRunConfig, before any process group (ValueError: a refusal)."""
    from megaloop import runtime
    from megaloop.rl.config import parse_args
    from megaloop.training.run_config import check_before_imports

    cfg = parse_args(argv)  # --help and a flag argparse refuses answer before any heavy import
    check_before_imports(cfg)  # the flags' own mistakes, before torch and megatron-core load
    if cfg.checkpoint.exit_signal_handler:
        from megaloop.training import sigterm

        sigterm.catch()  # from now on, as pretraining does (megaloop.training.sigterm says why)
    from megaloop.device import refuse_cpu_fallback

    refuse_cpu_fallback(sys.argv[1:] if argv is None else argv)  # no CPU run on a GPU node
    runtime.set_attention_backend_env(cfg.model.attention_backend)
    runtime.quiet_megatron()
    from megaloop.parallel.initialize import single_process_env
    from megaloop.training import checkpointing

    single_process_env()
    ck = cfg.checkpoint
    if ck.use_checkpoint_args:
        changed = checkpointing.apply_checkpoint_args(cfg)
        if changed:
            runtime.print_rank_0("> --use-checkpoint-args: from the checkpoint "
                                 + ", ".join(changed))
    if ck.load and not ck.finetune and not is_rl_checkpoint(ck.load, ck.ckpt_step) and \
            os.path.isdir(ck.load) and checkpointing.resolve(ck.load, ck.ckpt_step) is not None:
        ck.finetune = True  # a pretrained checkpoint: RL starts from its weights (step 0)
    cfg.validate()
    check_environment(cfg)
    checkpointing.check_resume(ck.load, ck.ckpt_step, cfg.to_dict())
    return cfg


def check_environment(cfg) -> None:
    """The environment loads, its prompts() returns a list of Prompt, enough of them for a step,
    none empty, and its longest prompt plus --max-new-tokens fits --max-position-embeddings
    (ValueError naming the flag, or the environment and the prompt's index)."""
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.rl.environments import checked_prompts, load_environment

    rl = cfg.rl
    try:
        env = load_environment(rl.env, **rl.env_kwargs())
    except TypeError as exc:  # a keyword the class does not take
        raise ValueError(f"--env {rl.env}: {exc} (check --env-path / --env-limit / --env-args)") \
            from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"--env {rl.env}: {exc}") from None
    prompts = checked_prompts(env, rl.env)
    if len(prompts) < rl.prompts_per_step:
        raise ValueError(f"--prompts-per-step {rl.prompts_per_step}: --env {rl.env} has only "
                         f"{len(prompts)} prompts; lower it")
    tokenizer = build_tokenizer(cfg.tokenizer)
    source = f" (read from --env-path {rl.env_path})" if rl.env_path is not None else ""
    longest = 0
    for i, prompt in enumerate(prompts):
        try:
            length = len(tokenizer.tokenize(prompt.text))
        except ValueError as exc:
            if cfg.tokenizer.tokenizer_type == "NullTokenizer":
                raise ValueError(
                    f"--tokenizer-type NullTokenizer reads text as space-separated token ids, "
                    f"and prompt {i} of --env {rl.env} is text ({prompt.text[:40]!r}); pass "
                    f"the tokenizer the model was trained with (--tokenizer-type, "
                    f"--tokenizer-model)") from None
            raise ValueError(f"--env {rl.env}: prompt {i} does not tokenize with "
                             f"--tokenizer-type {cfg.tokenizer.tokenizer_type}: {exc}") from None
        if length == 0:  # the sampler continues a prompt: it needs a last token
            shown = prompt.text if len(prompt.text) <= 40 else prompt.text[:40] + "..."
            raise ValueError(f"--env {rl.env}: prompt {i} (counting from 0){source} has no "
                             f"tokens (its text is {shown!r}); every prompt needs at least one "
                             f"token for the policy to continue: give it text, or leave it out")
        longest = max(longest, length)
    limit = cfg.model.max_position_embeddings
    if longest + rl.max_new_tokens > limit:
        raise ValueError(f"--max-new-tokens {rl.max_new_tokens}: the longest prompt of --env "
                         f"{rl.env} has {longest} tokens, and {longest} + {rl.max_new_tokens} "
                         f"exceeds --max-position-embeddings {limit}; lower --max-new-tokens "
                         f"or pass shorter prompts")


def run(argv: Optional[list] = None) -> int:
    """train_rl.py's whole sequence; returns the process's exit code (0 trained, 1 failed,
    2 refused: megaloop/training/run.py)."""
    from megaloop.training.startup import StartupTimer

    startup = StartupTimer()
    try:
        cfg = configure(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    from megaloop import cpu_shim, runtime
    from megaloop.parallel import initialize
    from megaloop.training.run import start, train

    try:
        start(cfg, startup)
        return train(cfg, startup, trainer_class=rl_trainer_class())
    finally:
        if cpu_shim.is_enabled() and cpu_shim.call_sites():
            runtime.print_rank_0("> CPU shim call sites:\n" + cpu_shim.format_call_sites())
        initialize.destroy()


def rl_trainer_class():
    """RLTrainer (its module imports megatron-core: loaded only after the flags are checked)."""
    from megaloop.rl.trainer import RLTrainer

    return RLTrainer
