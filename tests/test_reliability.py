"""Never train on garbage: non-finite steps, alarms that only fire where they mean something, and
a command line that answers mistakes in one line.

Non-finite steps are made on purpose: the loss of chosen iterations is multiplied by NaN inside
the schedule's loss function, so its gradients are NaN exactly there (on chosen ranks only, where
the test says so) and everywhere else the run is the ordinary one.
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy
import torch

from distributed import run_distributed
from reference import full_params
from test_training import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _poison(iterations, ranks=None):
    """From now on in this process, the loss of training iterations ``iterations`` (1-based) is
    multiplied by NaN on ``ranks`` (all when None)."""
    from megaloop.training import trainer as trainer_mod

    current = {}
    step = trainer_mod.Trainer.train_step

    def train_step(self):
        current["iteration"] = self.iteration + 1
        return step(self)

    real = trainer_mod.loss_func

    def loss_func(*args, **kwargs):
        total, tokens, report = real(*args, **kwargs)
        if current.get("iteration") in iterations and (
                ranks is None or torch.distributed.get_rank() in ranks):
            total = total * float("nan")
        return total, tokens, report

    trainer_mod.Trainer.train_step = train_step
    trainer_mod.loss_func = loss_func


def _skip_run(rank, world, flags):
    """Train with a NaN loss at iteration 2 on the last rank only; returns per iteration the
    weights, the LR-schedule position and the skipped count."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    _poison({2}, ranks={world - 1})
    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    out = []
    for _ in range(3):
        stats, grad_norm, ok = trainer.train_step()
        trainer.iteration += 1
        out.append((ok, float(grad_norm), trainer.scheduler.num_steps, trainer.skipped,
                    full_params(trainer.model)))
    return out


def test_nonfinite_step_is_skipped_on_every_rank_and_counted():
    # DP=2 with the NaN on rank 1's micro-batch only: both ranks must skip the same step.
    ranks = run_distributed(_skip_run, 2, BASE + ["--micro-batch-size", "1"])
    for (ok1, _, sched1, skip1, p1), (ok2, gn2, sched2, skip2, p2), (ok3, _, sched3, skip3, p3) \
            in ranks:
        assert (ok1, ok2, ok3) == (True, False, True)
        assert math.isnan(gn2)
        assert (skip1, skip2, skip3) == (0, 1, 1)
        assert (sched1, sched2, sched3) == (1, 1, 2)  # no LR-schedule step for the skipped one
        for k in p1:
            assert torch.equal(p1[k], p2[k]), k  # the skipped step changed no weight
            assert torch.isfinite(p3[k]).all() and not torch.equal(p2[k], p3[k]), k
    for k in ranks[0][2][4]:  # the ranks stayed identical
        assert torch.equal(ranks[0][2][4][k], ranks[1][2][4][k])


def _guard_cases(rank, world):
    from megaloop.training.diagnostics import NonFiniteGuard

    guard = NonFiniteGuard(True, 3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    out = {}
    for name, value in [("finite", None), ("large finite", 1e30), ("nan", float("nan")),
                        ("inf", float("inf")), ("-inf", -float("inf"))]:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if value is not None:
            model[1].weight.grad[2, 7] = value  # one entry of one gradient
        out[name] = guard.step_is_finite(model, 1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    out["nan loss"] = guard.step_is_finite(model, float("nan"))
    return out


def test_the_guard_finds_one_non_finite_gradient_entry():
    """The guard's test (the sum of each gradient buffer) against what it stands for: any
    NaN or infinity in any gradient, or in the loss, and nothing else (a finite 1e30 passes)."""
    assert run_distributed(_guard_cases, 1)[0] == {
        "finite": True, "large finite": True, "nan": False, "inf": False, "-inf": False,
        "nan loss": False}


def _main(rank, world, flags, poison):
    """pretrain_looplm.main in this rank (the harness's process group is reused)."""
    sys.path.insert(0, ROOT)
    import pretrain_looplm

    _poison(poison)
    return pretrain_looplm.main(flags)


def test_diverged_run_stops_after_skipped_steps_in_a_row(tmp_path):
    log, status, ckpt = tmp_path / "log.jsonl", tmp_path / "status.json", tmp_path / "ckpt"
    flags = BASE + ["--micro-batch-size", "2", "--train-iters", "8", "--log-jsonl", str(log),
                    "--max-skipped-steps-in-a-row", "3", "--save", str(ckpt),
                    "--save-interval", "1", "--exit-status-file", str(status)]
    code = run_distributed(_main, 1, flags, set(range(2, 9)))[0]
    assert code == 1
    train = [r for r in _records(log) if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]  # stopped at the third skip in a row
    assert [r["skipped_iters"] for r in train] == [0, 1, 2, 3]
    assert [r["grad_norm"] is None for r in train] == [False, True, True, True]  # NaN: null
    result = json.loads(status.read_text())
    assert result["status"] == "failed" and "--max-skipped-steps-in-a-row 3" in result["reason"]
    # Nothing was saved while skipping; the checkpoint of iteration 1, whose weights every
    # skipped step started from, is set aside: no checkpoint is left to resume from.
    assert sorted(os.listdir(ckpt)) == ["iter_0000001.diverged"]
    assert "set aside" in result["reason"] and "No checkpoint was saved before them" in \
        result["reason"] and result["checkpoint_iteration"] is None


def test_nonfinite_weights_are_never_saved(tmp_path):
    """Without the step check the NaN reaches the weights: the save refuses them, `latest`
    keeps naming the last finite checkpoint, nothing partial stays and the run exits 1."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = BASE + ["--micro-batch-size", "2", "--train-iters", "4", "--save", str(ckpt),
                    "--save-interval", "1", "--check-for-nan-in-loss-and-grad", "false",
                    "--exit-status-file", str(status)]
    code = run_distributed(_main, 1, flags, {2})[0]
    assert code == 1
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    reason = json.loads(status.read_text())["reason"]
    assert "not saving iteration 2" in reason and "not finite" in reason \
        and "iteration 1" in reason


# --- alarms -------------------------------------------------------------------------------------
class _Printer:
    is_writer = True

    def __init__(self):
        self.lines = []

    def print(self, text):
        self.lines.append(text)


def _diagnostics(extra):
    from megaloop.training.diagnostics import LoopDiagnostics
    from megaloop.training.run_config import parse_args

    cfg = parse_args(BASE + ["--p0-collapse-iters", "2", "--log-loop-geometry", "false"] + extra)
    printer = _Printer()
    return LoopDiagnostics(cfg, torch.nn.Linear(1, 1), printer), printer


def test_p0_collapse_alarm_watches_only_runs_with_a_gate():
    for extra, probs, alarms in ((["--num-loops", "1"], [1.0], 0),          # dense: p0 = 1
                                 (["--num-loops", "3", "--exit-loss", "last"], [float("nan")] * 3,
                                  0),                                         # no gate either
                                 (["--num-loops", "3"], [0.99, 0.005, 0.005], 1)):
        diag, printer = _diagnostics(extra)
        for it in range(1, 5):
            diag.after_step({"loss": 3.0, "exit_probs": probs, "tokens": 8}, it)
        assert sum("exit-gate collapse" in line for line in printer.lines) == alarms, extra


def _write_indexed(prefix, base, num_docs, doc_len):
    """Documents whose every token is ``base + document index``: a sample's tokens name its
    documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for d in range(num_docs):
        builder.add_document(torch.full((doc_len,), base + d, dtype=torch.int32), [doc_len])
    builder.finalize(prefix + ".idx")
    return prefix


def _blend_spike(rank, world, tmp):
    from megaloop.data.config import DataConfig, TokenizerConfig
    from megaloop.data.datasets import build_train_valid_test_datasets
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.parallel.initialize import initialize
    from megaloop.parallel.config import ParallelConfig
    from megaloop.training.diagnostics import describe_samples

    initialize(ParallelConfig(), 1)
    a = _write_indexed(os.path.join(tmp, "a"), 100, 30, 12)
    b = _write_indexed(os.path.join(tmp, "b"), 300, 30, 12)
    data = DataConfig(data_path=["0.5", a, "0.5", b], split="98,1,1")
    tokenizer = build_tokenizer(TokenizerConfig(vocab_size=1000))
    train, _, _ = build_train_valid_test_datasets(data, tokenizer, 16, 1234, (40, 0, 0))
    first, count = 8, 4
    text = describe_samples(train, first, count, limit=count)
    # What the samples' own tokens say: dataset by the token range, documents by the values.
    expected = []
    for i in range(first, first + count):
        tokens = sorted({int(t) for t in train[i]["tokens"].tolist()}
                        | {int(t) for t in train[i]["labels"].tolist()})
        name = a if tokens[0] < 300 else b
        base = 100 if name == a else 300
        expected.append((os.path.basename(name), [t - base for t in tokens]))
    diag, printer = _diagnostics([])
    # 40 quiet iterations: a spike waits for the window (15) and 20 losses after it, which
    # measure the run's loss noise (megaloop/training/diagnostics.py, LossSpikeCounter)
    for it in range(1, 41):
        diag.after_step({"loss": 3.0, "exit_probs": [], "tokens": 8}, it)
    diag.after_step({"loss": 9.0, "exit_probs": [], "tokens": 8}, 41,
                    describe_batch=lambda: describe_samples(train, first, count))
    return text, expected, printer.lines


def test_loss_spike_names_the_iteration_and_the_data(tmp_path):
    text, expected, lines = run_distributed(_blend_spike, 1, str(tmp_path))[0]
    assert "samples 8..11" in text
    named = [(name, sorted(json.loads(docs)))
             for name, _, docs in re.findall(r"(\w+)\[(\d+)\]: (\[[^\]]*\])", text)]
    assert named == expected, text  # every sample: its dataset and exactly its documents
    spike = [line for line in lines if "loss spike" in line]
    assert len(spike) == 1 and "iteration 41" in spike[0] and "samples 8..11" in spike[0]


# --- the command line ---------------------------------------------------------------------------
def test_unknown_flag_is_one_line_naming_the_closest_flag():
    proc = subprocess.run([sys.executable, "pretrain_looplm.py", "--hiden-size", "64"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--hiden-size" in lines[0] and "did you mean" in lines[0] \
        and "--hidden-size" in lines[0] and "--help" in lines[0]


def test_every_size_flag_is_range_checked():
    import dataclasses

    from megaloop.arguments import flag_name
    from megaloop.training.run_config import SECTIONS, SIZE_LIMITS, parse_args

    unchecked = []
    for section, limits in SIZE_LIMITS.items():
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        for name, low in limits.items():
            flag = flag_name(fields[name])
            try:
                parse_args(BASE + [flag, str(low - 1)]).validate(world_size=1)
            except ValueError as exc:
                if f"{flag} {low - 1}" in str(exc):
                    continue
                unchecked.append(f"{flag}: {exc}")
            except Exception as exc:  # noqa: BLE001 - what today's code raises instead
                unchecked.append(f"{flag}: {type(exc).__name__}: {exc}")
            else:
                unchecked.append(f"{flag} {low - 1}: accepted")
    assert not unchecked, "\n".join(unchecked)
    # The sizes megatron-core divides by are among them.
    assert {"hidden_size", "num_attention_heads", "ffn_hidden_size"} <= set(SIZE_LIMITS["model"])


def test_without_torchrun_the_script_runs_as_one_process(plain_launch):
    """python pretrain_looplm.py with no launcher's variables (tests/conftest.py's plain_launch):
    a world of one process that trains."""
    proc = plain_launch["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["iteration"] for r in _records(plain_launch["log"]) if r["split"] == "train"] == \
        list(range(1, plain_launch["iters"] + 1))
    assert "DP 1" in proc.stdout
