"""train_rl.py's RL step (megaloop/rl/train.py, megaloop/rl/trainer.py) on forked gloo ranks with
a tiny looped model and an environment of NullTokenizer ids written to a file (a user's
FILE.py:Class):

- TP=2 gives the update of TP=1 (parameters after one step, the loss and grad norm);
- an RL run stopped after 2 steps and resumed (--exit-interval, then --load) ends where the
  straight 3-step run ends, bitwise, with the reference policy the checkpoint it started from;
- RLTT with loop weights (0, ..., 0, 1) gives GRPO's update exactly;
- a batch whose groups all have equal rewards changes no parameter (KL beta 0);
- the logged loss and gradient norm of two steps equal a single-process computation through
  megaloop/rl/objectives.py from the logged rollouts (DP=2, several micro-batches,
  sequence-mean, RLTT progressive weights, a KL term); the log's per-token sampling log-probs
  are the sampling weights' full-depth log-probs, and its weight version the step before.
"""

import json
import os

import pytest
import torch

from distributed import run_distributed
from flags import LLAMA_STYLE_FLAGS
from test_placement import check_placement

ENV = '''
from megaloop.rl.environments import Environment, Prompt


class EvenSum(Environment):
    """Prompts of NullTokenizer ids; reward 1 when the completion's ids sum to an even number
    (``constant``: every completion gets that reward instead)."""

    def __init__(self, size: int = 16, constant=None):
        self.constant = constant
        self.items = [Prompt(" ".join(str((7 * i + j) % 60) for j in range(2 + i % 3)), "")
                      for i in range(size)]

    def prompts(self):
        return self.items

    def reward(self, prompt, completion):
        if self.constant is not None:
            return self.constant
        return float(sum(int(x) for x in completion.split()) % 2 == 0)
'''

MODEL = [*LLAMA_STYLE_FLAGS, "--transformer-impl", "auto", "--distributed-backend", "auto",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--max-position-embeddings", "32", "--num-loops", "3", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "63"]
RL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6",
      "--micro-batch-size", "4", "--lr", "1e-2", "--log-interval", "1"]


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "even_sum.py"
    path.write_text(ENV)
    return f"{path}:EvenSum"


def _full_params(model) -> dict:
    """Every parameter at full size (tensor-parallel shards gathered), by name."""
    from megatron.core import parallel_state

    from megaloop.checkpoint.format import unwrap

    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in unwrap(model).named_parameters():
        t = p.detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(parts, t.contiguous(),
                                         group=parallel_state.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight"):  # SwiGLU: each shard is [gate_r; up_r]
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t
    return out


def _rl(rank, world, argv, watch=False):
    """train_rl.py's sequence in this rank: (exit code, parameters before, parameters after,
    the JSONL records); ``watch``: also the parameters before every step."""
    from megaloop.rl.train import configure, rl_trainer_class
    from megaloop.training.run import start, train

    check_placement()  # every RL run here fails where a GPU run would misplace a tensor
    cfg = configure(argv)
    start(cfg)
    seen = {}

    def on_trainer(trainer):
        seen["trainer"], seen["before"], seen["steps"] = trainer, _full_params(trainer.model), []
        if watch:
            step = trainer.train_step

            def watched():
                seen["steps"].append(_full_params(trainer.model))
                return step()
            trainer.train_step = watched

    code = train(cfg, on_trainer=on_trainer, trainer_class=rl_trainer_class())
    log = cfg.logging.log_jsonl
    records = [json.loads(x) for x in open(log)] if log and os.path.exists(log) else []
    return code, seen["before"], _full_params(seen["trainer"].model), records, seen["steps"]


def _changed(before, after) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_tp2_update_equals_tp1(env_file, tmp_path):
    # --adam-eps 1: Adam's first step is lr * g / (|g| + 1), linear in the gradient, so rounding
    # differences between layouts stay rounding-sized (with eps 1e-8 it is lr * sign(g)).
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "1", "--adam-eps", "1",
            "--lr", "0.5", "--kl-beta", "0.1"]
    one = run_distributed(_rl, 1, argv + ["--log-jsonl", str(tmp_path / "tp1.jsonl")])[0]
    two = run_distributed(_rl, 2, argv + ["--tensor-model-parallel-size", "2",
                                          "--log-jsonl", str(tmp_path / "tp2.jsonl")])
    assert one[0] == 0 and two[0][0] == 0
    assert _changed(one[1], one[2])
    for k in one[1]:
        assert torch.allclose(two[0][1][k], one[1][k], atol=1e-6), k  # same initial weights
        assert torch.allclose(two[0][2][k] - two[0][1][k], one[2][k] - one[1][k],
                              atol=1e-6, rtol=1e-4), k
    r1, r2 = one[3][-1], two[0][3][-1]
    assert r1["reward_mean"] == r2["reward_mean"]  # the same rollouts
    for key in ("loss", "grad_norm", "kl"):
        assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-7), key


def _pretrained(rank, world, argv, path, norm_noise=0.0):
    """A checkpoint that is not an RL one (weights of seed 99) to start RL from; ``norm_noise``:
    the norm weights (initialised to 1) moved by that much noise, to values bf16 rounds."""
    from distributed import setup_parallel
    from megaloop.model.looped_gpt import build_model
    from megaloop.rl.train import configure
    from megaloop.training import checkpointing

    cfg = configure(argv)
    setup_parallel(1, seed=99)
    model = build_model(cfg.model, cfg.loop, 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * norm_noise)
    checkpointing.save_checkpoint(path, 5, model, run_config=cfg.to_dict())


def test_resume_mid_rl_is_bitwise(env_file, tmp_path):
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "3", "--kl-beta", "0.5",
            "--use-distributed-optimizer", "--prompts-per-step", "2", "--micro-batch-size", "2"]
    pre = str(tmp_path / "pretrained")
    run_distributed(_pretrained, 1, argv, pre)
    straight = run_distributed(_rl, 2, argv + [
        "--load", pre, "--save", str(tmp_path / "a"), "--log-jsonl", str(tmp_path / "a.jsonl")])
    log = str(tmp_path / "b.jsonl")
    first = run_distributed(_rl, 2, argv + [
        "--load", pre, "--save", str(tmp_path / "b"), "--exit-interval", "2",
        "--log-jsonl", log])
    resumed = run_distributed(_rl, 2, argv + [
        "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"), "--log-jsonl", log])
    assert [r[0] for r in straight + first + resumed] == [0] * 6
    assert [r["iteration"] for r in first[0][3]] == [1, 2]
    assert [r["iteration"] for r in resumed[0][3]] == [1, 2, 3]
    for rank in range(2):
        a, b = straight[rank][2], resumed[rank][2]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [_untimed(r) for r in resumed[0][3]] == [_untimed(r) for r in straight[0][3]]
    assert straight[0][3][2]["kl"] > 0  # the reference (the pretrained weights) matters


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k not in ("ms_per_iter", "rollout_s", "update_s", "startup_s")}


def test_rltt_last_weights_equal_grpo(env_file, tmp_path):
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "1", "--kl-beta", "0.1"]
    grpo = run_distributed(_rl, 1, argv)[0]
    last = run_distributed(_rl, 1, argv + ["--objective", "rltt", "--loop-weighting", "last"])[0]
    uniform = run_distributed(_rl, 1, argv + ["--objective", "rltt",
                                              "--loop-weighting", "uniform"])[0]
    assert _changed(grpo[1], grpo[2])
    assert all(torch.equal(grpo[2][k], last[2][k]) for k in grpo[2])
    assert _changed(grpo[2], uniform[2])  # the weights do reach the update


def test_equal_rewards_change_no_parameter(env_file, tmp_path):
    # The mean of three 0.1s is not 0.1 in floats: (r - mean) / (std + eps) would be ~1e-11,
    # which Adam's normalisation turns into a full-size update.
    argv = [*MODEL, *RL, "--env", env_file, "--env-args", "constant=0.1", "--train-iters", "2",
            "--group-size", "3",
            "--weight-decay", "0", "--log-jsonl", str(tmp_path / "log.jsonl")]
    code, before, after, records, _ = run_distributed(_rl, 1, argv)[0]
    assert code == 0 and not _changed(before, after)
    assert [r["uniform_reward_groups"] for r in records] == [1.0, 1.0]
    assert [r["grad_norm"] for r in records] == [0.0, 0.0]


def _hand(rank, world, argv, snapshots, rollouts, records, G, alpha, beta, clip):
    """Each step's loss and grad norm, one process, from the logged rollouts: a model holding
    the weights before the step, the reference holding the weights before step 1."""
    from distributed import setup_parallel
    from megaloop.model.looped_gpt import build_model
    from megaloop.rl.config import parse_args
    from megaloop.rl.logprobs import step_log_probs
    from megaloop.rl.objectives import group_advantages, grpo_loss, loop_weights, rltt_log_probs

    setup_parallel(1)
    cfg = parse_args(argv)
    out = []
    for step, weights in enumerate(snapshots, start=1):
        models = []
        for state in (weights, snapshots[0]):
            m = build_model(cfg.model, cfg.loop, 64)
            with torch.no_grad():
                for name, p in m.named_parameters():
                    p.copy_(state[name])
            models.append(m)
        rows = [r for r in rollouts if r["step"] == step]
        width = max(len(r["tokens"]) for r in rows)
        tokens = torch.full((len(rows), width), 63, dtype=torch.long)
        mask = torch.zeros(len(rows), width - 1)
        for b, r in enumerate(rows):
            tokens[b, :len(r["tokens"])] = torch.tensor(r["tokens"])
            mask[b, r["prompt_length"] - 1:len(r["tokens"]) - 1] = 1.0
        rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64).view(-1, G)
        w = loop_weights("progressive", 3, alpha)
        policy_steps, _ = step_log_probs(models[0], tokens, 64, 3, 0.9)
        # each token's logged sampling log-prob: the sampling policy's at step T, temperature 0.9
        gap = max((policy_steps[-1, b, r["prompt_length"] - 1:len(r["tokens"]) - 1].double()
                   - torch.tensor(r["sampling_logprobs"], dtype=torch.float64)).abs().max().item()
                  for b, r in enumerate(rows))
        with torch.no_grad():
            ref_steps, _ = step_log_probs(models[1], tokens, 64, 3, 0.9)
        logp = rltt_log_probs(policy_steps, w)
        loss, _ = grpo_loss(logp, logp.detach(), rltt_log_probs(ref_steps, w),
                            group_advantages(rewards).flatten(), mask, clip_eps=clip,
                            kl_beta=beta, aggregation="sequence-mean")
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in models[0].parameters()
                              if p.grad is not None))
        out.append((float(loss), float(norm), gap))
    return out


def test_loss_and_grad_norm_equal_a_hand_computation(env_file, tmp_path):
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "2", "--micro-batch-size", "2",
            "--objective", "rltt", "--loop-weighting", "progressive",
            "--loop-weighting-alpha", "2", "--kl-beta", "0.3", "--clip-eps", "0.1",
            "--aggregation", "sequence-mean",
            "--log-jsonl", str(tmp_path / "log.jsonl"),
            "--rollout-log", str(tmp_path / "rollouts.jsonl")]
    ranks = run_distributed(_rl, 2, argv, True)
    records, snapshots = ranks[0][3], ranks[0][4]
    rollouts = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    assert len(rollouts) == 2 * 16 and len({r["prompt"] for r in rollouts if r["step"] == 1}) == 4
    hand = run_distributed(_hand, 1, argv, snapshots, rollouts, records, 4, 2.0, 0.3, 0.1)[0]
    for (loss, norm, gap), r in zip(hand, records):
        assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert gap < 1e-4, gap
    for r in rollouts:  # sampled by the weights before the step, every token at all 3 steps
        n = len(r["tokens"]) - r["prompt_length"]
        assert r["weight_version"] == r["step"] - 1 and r["exit_depths"] == [3] * n
        assert len(r["sampling_logprobs"]) == n
    assert records[1]["kl"] > 0  # step 2's policy is not the reference: the KL term counts
    # One update per rollout batch: the policy scores as the one that sampled (ratio 1).
    assert [r["clip_fraction"] for r in records] == [0.0, 0.0]


def _sampling_gap(rank, world, argv, weights, rows, step):
    """The largest gap between the logged sampling log-probs and the log-probs read out at loop
    step ``step`` (temperature 0.9) of a model holding ``weights``."""
    from distributed import setup_parallel
    from megaloop.model.looped_gpt import build_model
    from megaloop.rl.config import parse_args
    from megaloop.rl.logprobs import step_log_probs

    setup_parallel(1)
    cfg = parse_args(argv)
    model = build_model(cfg.model, cfg.loop, 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        gaps = []
        for r in rows:
            steps, _ = step_log_probs(model, torch.tensor([r["tokens"]]), 64, 3, 0.9)
            read = steps[step - 1, 0, r["prompt_length"] - 1:len(r["tokens"]) - 1].double()
            gaps.append((read - torch.tensor(r["sampling_logprobs"],
                                             dtype=torch.float64)).abs().max().item())
    return max(gaps)


def test_rollouts_with_early_exit_log_their_depth(env_file, tmp_path):
    """--rollout-exit fixed:2: every rollout token is drawn from loop step 2's readout (its
    logged log-prob is step 2's, not step 3's, of the weights that sampled) and logs depth 2."""
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "1", "--rollout-exit", "fixed:2",
            "--rollout-log", str(tmp_path / "rollouts.jsonl")]
    code, before = run_distributed(_rl, 1, argv)[0][:2]
    assert code == 0
    rows = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    assert len(rows) == 16
    for r in rows:
        assert r["exit_depths"] == [2] * (len(r["tokens"]) - r["prompt_length"])
    at_two, at_three = (run_distributed(_sampling_gap, 1, argv, before, rows, t)[0]
                        for t in (2, 3))
    assert at_two < 1e-4 < at_three, (at_two, at_three)


def test_rollout_exit_is_checked_before_any_process_group():
    from megaloop.rl.config import parse_args

    with pytest.raises(ValueError, match="--rollout-exit 'q:2': write q:<q in"):
        parse_args([*MODEL, *RL, "--env", "demo-tasks", "--rollout-exit", "q:2"]).validate(1)



def _dtypes(rank, world, argv):
    """(policy, reference): the dtype of every parameter, by name, of the built RL trainer."""
    from megaloop.checkpoint.format import unwrap
    from megaloop.rl.train import configure, rl_trainer_class
    from megaloop.training.run import start
    from megaloop.training.trainer import Trainer

    cfg = configure(argv)
    start(cfg)
    trainer = rl_trainer_class()(cfg)
    assert isinstance(trainer, Trainer)
    return [{n: p.dtype for n, p in unwrap(m).named_parameters()}
            for m in (trainer.model, trainer.reference)]


def test_bf16_reference_is_the_policy_at_step_one(env_file, tmp_path):
    """--bf16: the policy runs inside megatron-core's Float16Module (every weight bf16, the
    local layers' norms included); the frozen reference holds the same weights and runs the
    same way: every parameter of the dtype of the policy's, and before the first update the
    two score every sampled token alike (the logged KL is exactly 0; on a GPU an fp32 norm
    weight meets a bf16 input in another kernel than the policy's). Step 2's KL is not 0: the
    reference does not follow the policy."""
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "2", "--bf16",
            "--log-jsonl", str(tmp_path / "log.jsonl")]
    policy, reference = run_distributed(_dtypes, 1, argv)[0]
    assert torch.bfloat16 in policy.values() and reference == policy
    code, _, _, records, _ = run_distributed(_rl, 1, argv)[0]
    assert code == 0
    assert records[0]["kl"] == 0.0, records[0]["kl"]
    assert records[1]["kl"] > 0


def test_bf16_resume_reads_the_reference_the_straight_run_used(env_file, tmp_path):
    """--bf16 from a checkpoint whose norm weights bf16 rounds: the straight run's reference is
    the policy's bf16 copy of them; a resumed run reads the reference from that checkpoint, and
    must round it as the policy does (an fp32 norm keeps the unrounded values: another KL)."""
    argv = [*MODEL, *RL, "--env", env_file, "--train-iters", "2", "--bf16"]
    pre = str(tmp_path / "pretrained")
    run_distributed(_pretrained, 1, argv, pre, 0.3)
    straight = run_distributed(_rl, 1, argv + ["--load", pre,
                                               "--log-jsonl", str(tmp_path / "a.jsonl")])[0]
    log = str(tmp_path / "b.jsonl")
    first = run_distributed(_rl, 1, argv + ["--load", pre, "--save", str(tmp_path / "b"),
                                            "--exit-interval", "1", "--log-jsonl", log])[0]
    resumed = run_distributed(_rl, 1, argv + ["--load", str(tmp_path / "b"),
                                              "--log-jsonl", log])[0]
    assert [straight[0], first[0], resumed[0]] == [0, 0, 0]
    assert [r["iteration"] for r in resumed[3]] == [1, 2]
    assert straight[3][1]["kl"] > 0
    assert [_untimed(r) for r in resumed[3]] == [_untimed(r) for r in straight[3]]
