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
    from megaloop.training.diagnostics import LossSpikeCounter

    c = LossSpikeCounter(threshold=0.5, window=15)
    losses = [3.0 - 0.01 * i for i in range(20)]
    losses += [3.5, 3.4]            # 0.5+ above the median for two iterations: one spike
    losses += [2.8] * 5 + [3.2]     # +0.4 above the median: not a spike
    losses += [float("nan")]        # a NaN loss counts
    flags = [c.update(x) for x in losses]
    assert c.count == 2 and flags.index(True) == 20
    # no spike can be declared before the window is full
    early = LossSpikeCounter(window=15)
    assert not any(early.update(x) for x in [1.0, 5.0, 9.0])


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
