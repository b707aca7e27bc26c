"""Loop diagnostics: per-step gradient norms against an unrolled model, the post-norm gradient
profile ("Closing the Loop" (arXiv 2610.00673) Fig. 6), geometry metrics against a hand computation,
spike and collapse counters, and everything reaching the trainer's log."""

import json
import math

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import lm_batch
from test_model import BATCH, SEQ, VOCAB, _model
from test_training import BASE


class _Unrolled(torch.nn.Module):
    """Stands in for the core: the t-th call of a forward runs the t-th independent copy."""

    def __init__(self, core, spec, T):
        from megatron.core.transformer.transformer_block import TransformerBlock

        super().__init__()
        self.copies = torch.nn.ModuleList(
            TransformerBlock(config=core.config, spec=spec, post_layer_norm=False)
            for _ in range(T))
        for c in self.copies:
            c.load_state_dict(core.state_dict())
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.copies[self.calls - 1](**kwargs)


def _layer_norms(block):
    return [math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in layer.parameters()))
            for layer in block.layers]


def _step_norms_vs_unrolled(rank, world, T, norm_scheme):
    from megaloop.model.instruments import StepGradNorms

    setup_parallel(world)
    model = _model(T, norm_scheme, num_layers=3, coda=1)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    diag = StepGradNorms(model, T)
    diag.start()
    out = model(ids, pos, None, labels=labels)
    out.objective.sum().backward()
    measured = diag.finish(num_tokens=1)
    total_grads = {n: p.grad.clone() for n, p in model.core.named_parameters()}
    model.zero_grad()

    # Independent computation: T untied copies of the core with the same weights.
    from megaloop.model.specs import layer_spec

    core = model.core
    model.core = _Unrolled(core, layer_spec(model.config, norm_scheme, use_te=False), T)
    out2 = model(ids, pos, None, labels=labels)
    out2.objective.sum().backward()
    assert torch.allclose(out.objective, out2.objective, atol=1e-6)
    reference = [_layer_norms(c) for c in model.core.copies]  # [step][layer]
    # The per-step contributions add up to the shared parameters' gradient.
    for name, g in total_grads.items():
        summed = sum(dict(c.named_parameters())[name].grad for c in model.core.copies)
        assert torch.allclose(summed, g, atol=1e-6, rtol=1e-5), name
    model.core = core
    return measured, reference


@pytest.mark.parametrize("norm_scheme", ["ouro", "pre"])
def test_step_grad_norms_equal_unrolled_copies(norm_scheme):
    T = 3
    measured, reference = run_distributed(_step_norms_vs_unrolled, 1, T, norm_scheme)[0]
    assert len(measured) == 2 and all(len(row) == T for row in measured)
    for layer in range(2):
        for t in range(T):
            ref = reference[t][layer]
            assert ref > 0
            assert abs(measured[layer][t] - ref) <= 1e-5 * ref, (layer, t)


# --- Closing the Loop Fig. 6: post-norm concentrates the gradient in the last layer
# -------------------------
def _depth_profile(rank, world, scheme):
    """Per-layer gradient norms at loop step t=2 of an 8-layer core looped T=4, after 30 Adam
    steps at a high LR on one batch: the post-norm failure develops with training (Closing the Loop
    Fig. 5 puts it in the first ~1K steps); at initialisation the two profiles look alike."""
    from megaloop.model.instruments import StepGradNorms

    setup_parallel(world)
    model = _model(4, scheme, num_layers=8)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        model(ids, pos, None, labels=labels).objective.mean().backward()
        opt.step()
    diag = StepGradNorms(model, 4)
    diag.start()
    opt.zero_grad()
    model(ids, pos, None, labels=labels).objective.mean().backward()
    return [row[1] for row in diag.finish(num_tokens=1)]  # step t=2, as in Fig. 6


def test_post_norm_gradients_vanish_below_last_layer_pre_norm_does_not():
    pre = run_distributed(_depth_profile, 1, "pre")[0]
    post = run_distributed(_depth_profile, 1, "post")[0]
    print("pre-norm  layer grad norms at t=2:", [f"{x:.2e}" for x in pre])
    print("post-norm layer grad norms at t=2:", [f"{x:.2e}" for x in post])
    assert max(post[:-1]) < 1e-2 * post[-1]       # early layers far below the last
    assert min(pre[:-1]) > 0.1 * pre[-1]           # pre-norm: not below the last layer


# --- geometry ------------------------------------------------------------------------------
def _geometry(rank, world):
    from megaloop.model.instruments import LoopGeometry

    setup_parallel(world)
    T = 3
    model = _model(T, "ouro")
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    states = []
    handle = model.core.register_forward_hook(
        lambda m, a, kw, out: states.append((kw["hidden_states"].clone(), out.clone())),
        with_kwargs=True)
    geo = LoopGeometry(model, T)
    geo.start()
    with torch.no_grad():
        model(ids, pos, None, labels=labels)
    result = geo.finish()
    handle.remove()
    return result, states


def test_geometry_matches_hand_computation():
    result, states = run_distributed(_geometry, 1)[0]
    T = len(states)
    ang, rel, var = [], [], []
    for u, v in states:  # [s, b, h], written out per token
        u, v = u.reshape(-1, u.shape[-1]).double(), v.reshape(-1, v.shape[-1]).double()
        a, r, w = [], [], []
        for x, y in zip(u, v, strict=True):
            c = float(x @ y / (x.norm() * y.norm()))
            a.append(math.acos(max(-1.0, min(1.0, c))) / math.pi)
            r.append(float((y - x).norm() / x.norm()))
            w.append(float(((y - y.mean()) ** 2).mean()))
        ang.append(sum(a) / len(a))
        rel.append(sum(r) / len(r))
        var.append(sum(w) / len(w))
    for t in range(T):
        assert abs(result["angular_distance"][t] - ang[t]) < 1e-5
        assert abs(result["relative_update_norm"][t] - rel[t]) < 1e-5
        assert abs(result["state_variance"][t] - var[t] / var[-1]) < 1e-5
    assert result["state_variance"][-1] == pytest.approx(1.0)


# --- counters ------------------------------------------------------------------------------
def test_loss_spike_counter():
    """Where the run's loss noise is small the rule is the paper's: 0.5 above the rolling
    median. (Was 20 warm-up losses: a spike now waits for the noise to be measured, 15 + 20.)"""
    from megaloop.training.diagnostics import LossSpikeCounter

    c = LossSpikeCounter(threshold=0.5, window=15)
    losses = [3.0 - 0.005 * i for i in range(40)]   # no noise: the limit is the threshold
    losses += [3.5, 3.4]            # 0.5+ above the median for two iterations: one spike
    losses += [2.8] * 5 + [3.2]     # +0.4 above the median: not a spike
    losses += [float("nan")]        # a NaN loss counts
    flags = [c.update(x) for x in losses]
    assert c.count == 2 and flags.index(True) == 40
    # No spike before the window is full and 20 losses after it have measured the noise.
    early = LossSpikeCounter(window=15)
    assert not any(early.update(x) for x in [1.0] * 34 + [9.0])
    ready = LossSpikeCounter(window=15)
    assert [ready.update(x) for x in [1.0] * 35 + [9.0]].index(True) == 35


# The per-iteration losses of a real tiny run: the demo model (0 + 2 x 4 + 0, hidden 128) on the
# demo corpus (prose mixed with arithmetic, binding and pointer problems), one 128-token sequence
# per iteration, 100 iterations, --lr 3e-3 with 30 warm-up iterations (examples/demo_cpu.sh's
# model and schedule at --global-batch-size 1). Its loss scatters by ~0.35 from one iteration to
# the next; the old rule (0.5 above the median of 15) warned at iterations 63, 66 and 70.
REAL_SMALL_RUN = [
    6.305, 6.304, 6.153, 6.276, 6.076, 5.922, 5.894, 5.819, 5.735, 5.582, 5.340, 5.592, 5.660,
    5.727, 5.378, 4.951, 4.817, 4.863, 4.921, 4.676, 4.899, 4.799, 4.823, 5.026, 4.268, 4.561,
    4.997, 4.770, 4.802, 4.569, 4.414, 4.726, 4.589, 4.534, 4.075, 4.670, 4.125, 4.940, 3.625,
    4.900, 3.774, 4.995, 4.439, 4.739, 5.065, 4.738, 4.847, 4.503, 5.132, 4.732, 4.171, 4.224,
    4.427, 4.720, 4.572, 4.351, 4.660, 4.275, 4.272, 4.229, 4.531, 4.260, 5.191, 4.689, 4.356,
    5.241, 4.570, 4.777, 4.378, 5.132, 5.211, 5.241, 4.641, 4.524, 4.967, 4.122, 4.732, 4.537,
    4.647, 4.687, 4.646, 4.182, 4.476, 4.342, 4.791, 4.254, 4.387, 4.560, 4.393, 4.773, 4.080,
    4.849, 4.733, 4.716, 4.428, 4.060, 4.389, 4.422, 4.665, 4.347]


def _spike_warnings(losses):
    """The WARNING lines the trainer's diagnostics print for this loss sequence (default
    --loss-spike-threshold and --loss-spike-window)."""
    from megaloop.training.diagnostics import LoopDiagnostics
    from megaloop.training.run_config import parse_args

    class Printer:
        is_writer = True

        def __init__(self):
            self.lines = []

        def print(self, text):
            self.lines.append(text)

    printer = Printer()
    diag = LoopDiagnostics(parse_args(BASE + ["--log-loop-geometry", "false"]),
                           torch.nn.Linear(1, 1), printer)
    for it, loss in enumerate(losses, start=1):
        diag.after_step({"loss": loss, "exit_probs": [0.4, 0.3, 0.3], "tokens": 128}, it)
    return [line for line in printer.lines if "loss spike" in line]


def test_a_normal_small_run_does_not_warn_of_a_spike():
    assert _spike_warnings(REAL_SMALL_RUN) == []


@pytest.mark.parametrize("factor", [3.0, 2.0])
def test_a_planted_spike_warns_once_naming_its_iteration(factor):
    import statistics

    losses = list(REAL_SMALL_RUN)
    local = statistics.median(losses[64:79])  # the 15 iterations before iteration 80
    losses[79] = factor * local
    warnings = _spike_warnings(losses)
    assert len(warnings) == 1 and "loss spike at iteration 80:" in warnings[0], warnings
    assert f"loss {factor * local:.4f}" in warnings[0] and "noise" in warnings[0]


def test_gate_collapse_monitor():
    from megaloop.training.diagnostics import GateCollapseMonitor

    m = GateCollapseMonitor(threshold=0.95, patience=3)
    fired = [m.update(p) for p in [0.99, 0.99, 0.5, 0.99, 0.96, 0.97, 0.98, 0.99]]
    assert fired == [False, False, False, False, False, True, False, False]
    assert m.run == 5 and not m.update(None) and m.run == 0


# --- through the trainer -------------------------------------------------------------------
def _train_logged(rank, world, extra, path):
    from run_helpers import build_trainer

    build_trainer(BASE + ["--log-jsonl", path, "--eval-iters", "1", "--eval-interval", "2",
                          "--p0-collapse-iters", "1", "--p0-collapse-threshold", "0.0"]
                  + extra).train()
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_logs_diagnostics(tmp_path, capsys, tp):
    path = str(tmp_path / f"log{tp}.jsonl")
    run_distributed(_train_logged, tp, ["--log-grad-norm-per-step", "--micro-batch-size", "2",
                                        "--tensor-model-parallel-size", str(tp)], path)
    records = [json.loads(line) for line in open(path)]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert len(train) == 2 and valid
    for r in train:
        norms = r["grad_norm_per_step"]
        assert len(norms) == 2 and all(len(row) == 3 and min(row) > 0 for row in norms)
        assert r["loss_spikes"] == 0 and r["p0_collapse_iters"] >= 1
    for key in ("angular_distance", "relative_update_norm", "state_variance"):
        assert len(valid[-1][key]) == 3
    test_trainer_logs_diagnostics.results[tp] = train
    if len(test_trainer_logs_diagnostics.results) == 2:  # TP=2 == TP=1
        a, b = (test_trainer_logs_diagnostics.results[k] for k in (1, 2))
        for ra, rb in zip(a, b, strict=True):
            for row_a, row_b in zip(ra["grad_norm_per_step"], rb["grad_norm_per_step"],
                                    strict=True):
                for x, y in zip(row_a, row_b, strict=True):
                    assert abs(x - y) <= 1e-4 * x


test_trainer_logs_diagnostics.results = {}


def test_step_grad_norms_pp2_equal_pp1(tmp_path):
    """Under PP each virtual chunk is one loop step: the per-step norms of both stages' layers,
    gathered into one table, equal the single-stage run's."""
    extra = ["--log-grad-norm-per-step", "--micro-batch-size", "2", "--num-layers", "4"]
    paths = [str(tmp_path / "pp1.jsonl"), str(tmp_path / "pp2.jsonl")]
    run_distributed(_train_logged, 1, extra, paths[0])
    run_distributed(_train_logged, 2, extra + ["--pipeline-model-parallel-size", "2"], paths[1])
    runs = [[json.loads(line) for line in open(p)] for p in paths]
    runs = [[r for r in records if r["split"] == "train"] for records in runs]
    assert len(runs[0]) == len(runs[1]) == 2
    for ra, rb in zip(*runs, strict=True):
        assert len(ra["grad_norm_per_step"]) == 4
        for row_a, row_b in zip(ra["grad_norm_per_step"], rb["grad_norm_per_step"], strict=True):
            assert len(row_a) == 3 and min(row_a) > 0
            for x, y in zip(row_a, row_b, strict=True):
                assert abs(x - y) <= 1e-4 * x
