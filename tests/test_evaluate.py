"""tools/evaluate.py and tools/plot_run.py on a tiny trained checkpoint.

The depth sweep at the training depth must give the trainer's own validation numbers (logged to
--log-jsonl) by default: per-step losses, the objective and the loop geometry of its final
evaluation for the last checkpoint, of its evaluation at iteration N for --ckpt-step N (each
evaluation reads the next samples of the validation split); TP=2 must give the TP=1 numbers; the
report must hold every depth with its regime.
"""

import json
import os

import numpy as np
import pytest

from distributed import run_distributed
from test_placement import check_placement
from test_inference import _generate_tool
from flags import TEST_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 200

TRAIN = [*TEST_FLAGS,
         "--num-layers", "2", "--num-loops", "3", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--log-interval", "1",
         "--eval-iters", "2", "--eval-interval", "1", "--split", "70,30,0"]


def _write_dataset(prefix: str) -> None:
    """60 random documents through megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(60):
        doc = rng.integers(0, VOCAB, size=int(rng.integers(20, 80)))
        builder.add_document(torch.from_numpy(np.append(doc, VOCAB).astype(np.int32)),
                             [len(doc) + 1])
    builder.finalize(prefix + ".idx")


def _train(rank, world, argv):
    check_placement()
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    Trainer(cfg).train()
    return True


def _tool(rank, world, name, argv, out_path):
    """Run tools/<name>.py's main in this rank; (exit code, its stdout). Its stderr goes to
    ``out_path.<rank>.err`` (the progress bar's)."""
    check_placement()
    import contextlib
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "megaloop", "cli", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with open(f"{out_path}.{rank}", "w") as f, contextlib.redirect_stdout(f), \
            open(f"{out_path}.{rank}.err", "w") as err, contextlib.redirect_stderr(err):
        code = tool.main(argv)
    return code, open(f"{out_path}.{rank}").read()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(checkpoint, data prefix, JSONL log) of a 3-iteration run validated and saved at every
    iteration: its evaluations at iterations 1, 2 and 3 (the final one) read the first, second
    and third --eval-iters batches of its split."""
    tmp = tmp_path_factory.mktemp("evaluate")
    prefix = str(tmp / "data_text_document")
    run_distributed(lambda rank, world: _write_dataset(prefix), 1)
    ckpt, log = str(tmp / "ckpt"), str(tmp / "run.jsonl")
    run_distributed(_train, 1, TRAIN + ["--data-path", prefix, "--save", ckpt,
                                        "--save-interval", "1", "--log-jsonl", log])
    return ckpt, prefix, log


def _sweep(tmp_path, ckpt, world, *extra):
    out = str(tmp_path / f"sweep{world}")
    results = run_distributed(_tool, world, "evaluate",
                              ["--load", ckpt, "--output-dir", out, *extra],
                              str(tmp_path / "stdout"))
    assert all(code == 0 for code, _ in results), results[0][1]
    with open(os.path.join(out, "depth_sweep.json")) as f:
        return json.load(f), out, results[0][1]


def test_training_depth_equals_trainer_validation(run, tmp_path):
    ckpt, _, log = run
    valids = [json.loads(line) for line in open(log) if '"valid"' in line]
    assert [v["iteration"] for v in valids] == [1, 2, 3]
    # Each evaluation read other samples: a sweep of one fixed window cannot match them all.
    assert len({round(v["loss"], 6) for v in valids}) == 3
    valid = valids[-1]  # the run's final validation, of the weights in the latest checkpoint
    sweep, out, stdout = _sweep(tmp_path, ckpt, 1, "--num-loops", "1,3,6",
                                "--exit-rules", "q:0.5,kl:0")
    assert "samples 16-23 (window 3: the trainer's 3rd evaluation, at iteration 3;" in stdout
    by_depth = {d["depth"]: d for d in sweep["depths"]}
    assert [d["regime"] for d in sweep["depths"]] == \
        ["under-unrolling", "training horizon", "extrapolation"]
    at_t = by_depth[3]
    np.testing.assert_allclose(at_t["step_losses"], valid["step_losses"], rtol=1e-5)
    np.testing.assert_allclose(at_t["objective"], valid["loss"], rtol=1e-5)
    np.testing.assert_allclose(at_t["exit_probs"], valid["exit_probs"], rtol=1e-4, atol=1e-6)
    for key in ("angular_distance", "relative_update_norm", "state_variance"):
        np.testing.assert_allclose(at_t["geometry"][key], valid[key], rtol=1e-4)
    assert at_t["tokens"] == 2 * 4 * 32  # --eval-iters x global batch x sequence
    for d in sweep["depths"]:
        k = d["depth"]
        assert len(d["step_losses"]) == k and d["loss"] == d["step_losses"][-1]
        assert d["perplexity"] == pytest.approx(np.exp(d["loss"]))
        # A k-step run's first steps are the same computation as a longer run's.
        np.testing.assert_allclose(d["step_losses"], by_depth[6]["step_losses"][:k], rtol=1e-5)
        if k > 1:
            assert sum(d["exit_probs"]) == pytest.approx(1.0, abs=1e-5)
            assert d["expected_exit_step"] == pytest.approx(
                sum((t + 1) * p for t, p in enumerate(d["exit_probs"])))
        # kl:0 never stops early (a KL is never below 0): the last step's loss at full depth.
        assert d["rules"]["kl:0"]["loss"] == pytest.approx(d["loss"], rel=1e-5)
        assert d["rules"]["kl:0"]["mean_depth"] == pytest.approx(k)
        assert 1 <= d["rules"]["q:0.5"]["mean_depth"] <= k
    md = open(os.path.join(out, "depth_sweep.md")).read()
    for k, regime in ((1, "under-unrolling"), (3, "training horizon"), (6, "extrapolation")):
        assert f"| {k} | {regime} | {by_depth[k]['loss']:.4f} |" in md
    assert md.split("\n")[0] in stdout  # the table is printed too
    for png in ("loss_vs_depth.png", "exit_distribution.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _bar_counts(text: str) -> list[tuple[int, int]]:
    """Every ``n/total`` a tqdm bar printed (it redraws with carriage returns)."""
    import re

    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) \[", text)]


def test_progress_bar_counts_every_batch_pass(run, tmp_path):
    """The bar on stderr (rank 0 only) counts depths x batches x (1 + exit rules) batch passes
    and reaches that total; per-depth lines stay on stdout; --no-progress prints no bar."""
    ckpt = run[0]
    # The run's split: --eval-iters 2 x --global-batch-size 4 / --micro-batch-size 2 = 4
    # micro-batches, at 3 depths, each scored by the forward and by 2 rules: 4 x 3 x 3 = 36.
    flags = ["--num-loops", "1,2,3", "--exit-rules", "q:0.5,kl:0", "--plots", "false"]
    _, _, stdout = _sweep(tmp_path, ckpt, 2, *flags)
    err = [open(str(tmp_path / f"stdout.{rank}.err")).read() for rank in (0, 1)]
    counts = _bar_counts(err[0])
    assert counts and counts[-1] == (36, 36), err[0][-2000:]
    assert {total for _, total in counts} == {36}
    assert "depth sweep" in err[0] and "depth sweep" not in stdout
    assert _bar_counts(err[1]) == []  # rank 1 draws no second bar
    assert "depth   3 (training horizon): loss" in stdout
    (tmp_path / "quiet").mkdir()
    _, _, stdout = _sweep(tmp_path / "quiet", ckpt, 1, *flags, "--no-progress")
    quiet = open(str(tmp_path / "quiet" / "stdout.0.err")).read()
    assert _bar_counts(quiet) == [] and "depth sweep" not in quiet, quiet[-2000:]
    assert "depth   3 (training horizon): loss" in stdout


def test_tensor_parallel_sweep_equals_one_rank(run, tmp_path):
    ckpt = run[0]
    one, _, _ = _sweep(tmp_path, ckpt, 1, "--num-loops", "2,3", "--plots", "false",
                       "--exit-rules", "q:0.5")
    two, _, _ = _sweep(tmp_path, ckpt, 2, "--num-loops", "2,3", "--plots", "false",
                       "--exit-rules", "q:0.5")
    for a, b in zip(one["depths"], two["depths"]):
        np.testing.assert_allclose(a["step_losses"], b["step_losses"], rtol=1e-5)
        np.testing.assert_allclose(a["exit_probs"], b["exit_probs"], rtol=1e-4)
        assert a["rules"]["q:0.5"]["loss"] == pytest.approx(b["rules"]["q:0.5"]["loss"],
                                                            rel=1e-5)


def test_input_file_is_scored_in_windows(run, tmp_path):
    """--input-file: a text file of ids (NullTokenizer) cut into --seq-length + 1 windows; its
    loss at depth T equals a forward of the same windows scored by hand."""
    ckpt = run[0]
    rng = np.random.default_rng(1)
    docs = [" ".join(str(int(x)) for x in rng.integers(0, VOCAB, 40)) for _ in range(4)]
    path = tmp_path / "held.txt"
    path.write_text("\n\n".join(docs))
    sweep, _, _ = _sweep(tmp_path, ckpt, 1, "--num-loops", "3", "--input-file", str(path),
                         "--seq-length", "16", "--plots", "false", "--exit-rules", "none")
    stream = [int(x) for d in docs for x in (d.split() + [str(VOCAB)])]
    windows = np.array(stream[:len(stream) // 17 * 17]).reshape(-1, 17)
    windows = windows[:len(windows) // 2 * 2]  # whole micro-batches of 2
    assert sweep["depths"][0]["tokens"] == windows.size - len(windows)
    ref = run_distributed(_reference_loss, 1, ckpt, windows)[0]
    assert sweep["depths"][0]["loss"] == pytest.approx(ref, rel=1e-5)


def _reference_loss(rank, world, ckpt, windows):
    """Mean next-token cross-entropy of the last step's logits (the model's plain forward)."""
    check_placement()
    import torch

    from megaloop.device import current_device
    from megaloop.inference.loading import load_for_generation, setup_processes

    setup_processes()
    model, _, _ = load_for_generation(ckpt)  # on the device: so is its batch
    x = torch.tensor(windows, dtype=torch.long, device=current_device())
    pos = torch.arange(x.size(1) - 1, device=current_device()).expand(x.size(0), -1)
    with torch.no_grad():
        logits = model(x[:, :-1], pos, None)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             x[:, 1:].flatten()).item()


def test_bad_flags_are_named(run, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "evaluate", os.path.join(ROOT, "megaloop", "cli", "evaluate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ckpt = run[0]
    for argv, needle in (
            (["--load", ckpt, "--output-dir", "x", "--num-loops", "0,2"], "--num-loops"),
            (["--load", ckpt, "--output-dir", "x", "--exit-rules", "fixed:2"], "--exit-rules"),
            (["--load", ckpt, "--output-dir", "x", "--mock-data", "--input-file", "f"],
             "choose one data source"),
            (["--load", str(tmp_path / "nope"), "--output-dir", "x"], "no such directory")):
        assert tool.main(argv) == 2
        assert needle in capsys.readouterr().err


def test_plot_run_reads_every_logged_key(tmp_path):
    """A run with every diagnostic on (per-step grad norms, geometry, a gate): the plot tool
    knows every key of its log and draws the PNG; a file that is not a megaloop log is refused
    with the line that is wrong."""
    from megaloop.eval.run_plot import DRAWN, NOT_DRAWN, NotARunLog, read_run, unknown_keys

    log = str(tmp_path / "run.jsonl")
    run_distributed(_train, 1, TRAIN[:TRAIN.index("--split")] + [
        "--mock-data", "--eval-interval", "2", "--log-grad-norm-per-step",
        "--log-jsonl", log])
    records = read_run(log)
    keys = {k for r in records for k in r}
    assert {"grad_norm_per_step", "angular_distance", "exit_probs", "p0"} <= keys
    assert unknown_keys(records) == []
    assert not set(DRAWN) & set(NOT_DRAWN)
    out = str(tmp_path / "run.png")
    code, stdout = run_distributed(_tool, 1, "plot_run", [log, "--output", out],
                                   str(tmp_path / "plot_stdout"))[0]
    assert code == 0 and "per-step gradient norm" in stdout
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # A key the tool does not know is reported, not silently dropped.
    assert unknown_keys(records + [{"iteration": 1, "split": "train", "new_metric": 1}]) == \
        ["new_metric"]
    bad = tmp_path / "other.jsonl"
    bad.write_text(json.dumps({"iteration": 1, "split": "train"}) + "\n" +
                   json.dumps({"step": 2, "loss": 1.0}) + "\n")
    with pytest.raises(NotARunLog, match=r"other.jsonl:2: not a megaloop log record"):
        read_run(str(bad))
    bad.write_text("loss=1.0\n")
    with pytest.raises(NotARunLog, match=r"other.jsonl:1: not JSON"):
        read_run(str(bad))


def _export(rank, world, load, out):
    check_placement()
    from megaloop.convert.hf_export import export_hf
    from megaloop.parallel.initialize import initialize_single_process

    initialize_single_process()
    export_hf(load, out)
    return True


def test_exported_folder_scores_like_its_checkpoint(run, tmp_path):
    """--load of an export-hf folder (no training config: the shape and tokenizer come from the
    flags) gives the checkpoint's numbers on the same file."""
    ckpt = run[0]
    folder = str(tmp_path / "hf")
    run_distributed(_export, 1, ckpt, folder)
    rng = np.random.default_rng(2)
    path = tmp_path / "held.txt"
    path.write_text("\n\n".join(" ".join(str(int(x)) for x in rng.integers(0, VOCAB, 50))
                                for _ in range(3)))
    flags = ["--num-loops", "2,3", "--input-file", str(path), "--seq-length", "16",
             "--micro-batch-size", "2", "--plots", "false", "--exit-rules", "q:0.5"]
    ours, _, _ = _sweep(tmp_path, ckpt, 1, *flags)
    (tmp_path / "x").mkdir()
    exported, _, _ = _sweep(tmp_path / "x", folder, 1, *flags, "--tokenizer-type",
                            "NullTokenizer", "--vocab-size", str(VOCAB))
    for a, b in zip(ours["depths"], exported["depths"]):
        np.testing.assert_allclose(a["step_losses"], b["step_losses"], rtol=1e-5)
        assert a["rules"]["q:0.5"] == pytest.approx(b["rules"]["q:0.5"], rel=1e-5)


def _task_accuracy_vs_greedy(rank, world, ckpt):
    """Problems whose answer is (even items) or is not (odd items: last token changed) the
    model's own greedy continuation at depth 3: the scorer must say exactly which."""
    check_placement()
    import torch

    from megaloop.eval.tasks import accuracy, encode
    from megaloop.inference.generate import Generator, SamplingParams
    from megaloop.inference.loading import load_for_generation, setup_processes

    setup_processes()
    model, tok, _ = load_for_generation(ckpt)
    gen = Generator(model, tok.vocab_size, num_loops=3, kv_policy="full")
    rng = np.random.default_rng(3)
    items = []
    for i in range(12):
        question = [int(x) for x in rng.integers(0, VOCAB, 10)]
        answer = gen.generate([question], 2, SamplingParams(temperature=0.0))[0]
        if i % 2:
            answer[-1] = (answer[-1] + 1) % VOCAB
        items.append({"family": ["a", "b"][i % 3 == 0], "k": 1 + i % 2,
                      "question": " ".join(map(str, question)),
                      "answer": " ".join(map(str, answer))})
    with torch.no_grad():
        acc = accuracy(model, encode(items, tok, 32), items, 3, tok.vocab_size, batch_size=5)
    return acc


def _files(folder) -> list:
    return sorted(os.path.relpath(os.path.join(d, n), folder)
                  for d, _, names in os.walk(folder) for n in names)


def test_the_index_cache_goes_where_the_outputs_go(run, tmp_path):
    """The validation split's index cache is written under --output-dir (or --data-cache-path),
    never next to the data: for the demo, whose corpus lives in the checkout's demo/, that was
    the checkout's demo/cache. Here a copy of the data in its own folder stands for the
    checkout: after the sweep it holds the data files and nothing else."""
    import shutil

    prefix = run[1]
    home = tmp_path / "checkout" / "demo"  # (no cache of the training run beside this copy)
    home.mkdir(parents=True)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, home / ("corpus_text_document" + ext))
    before = _files(home)
    data = ["--data-path", str(home / "corpus_text_document"), "--split", "70,30,0",
            "--num-loops", "3", "--plots", "false", "--exit-rules", "none"]
    _, out, _ = _sweep(tmp_path, run[0], 1, *data)
    assert _files(home) == before
    assert any(f.startswith(os.path.join("cache", "megaloop-")) for f in _files(out)), \
        _files(out)
    elsewhere = tmp_path / "index_cache"
    (tmp_path / "given").mkdir()
    _sweep(tmp_path / "given", run[0], 1, *data, "--data-cache-path", str(elsewhere))
    assert _files(home) == before and _files(elsewhere)
    assert not any(f.startswith("cache") for f in _files(tmp_path / "given" / "sweep1"))


def test_task_accuracy_equals_greedy_decoding(run):
    acc = run_distributed(_task_accuracy_vs_greedy, 1, run[0])[0]
    assert acc["overall"] == 0.5
    # k = 1 items are the even ones (the model's own answers), k = 2 the altered ones.
    for family in acc["by_family"].values():
        assert family == {1: 1.0, 2: 0.0}


def test_ckpt_step_scores_what_the_trainer_scored_then(run, tmp_path):
    """--ckpt-step N loads iteration N, scored by default on the samples of the trainer's
    evaluation at N: its logged validation loss; --valid-window picks another evaluation's."""
    ckpt, _, log = run
    valids = {v["iteration"]: v for v in map(json.loads, open(log)) if v.get("split") == "valid"}
    for step in (1, 2):
        (tmp_path / f"s{step}").mkdir()
        sweep, _, stdout = _sweep(tmp_path / f"s{step}", ckpt, 1, "--ckpt-step", str(step),
                                  "--num-loops", "3", "--plots", "false", "--exit-rules", "none")
        np.testing.assert_allclose(sweep["depths"][0]["objective"], valids[step]["loss"],
                                   rtol=1e-5)
        assert f"the trainer's {['1st', '2nd'][step - 1]} evaluation, at iteration {step}" \
            in stdout
    # The latest weights on the first window are not what any evaluation of them scored.
    (tmp_path / "w1").mkdir()
    sweep, _, stdout = _sweep(tmp_path / "w1", ckpt, 1, "--valid-window", "1", "--num-loops",
                              "3", "--plots", "false", "--exit-rules", "none")
    assert "samples 0-7 (window 1" in stdout
    assert sweep["depths"][0]["objective"] != pytest.approx(valids[3]["loss"], rel=1e-4)


def test_plot_of_a_diverged_run_marks_non_finite_points_and_labels_every_line(tmp_path):
    """A run whose loss turned NaN, then infinite, then was logged as null (the trainer writes
    non-finite values as null): the loss and gradient-norm panels mark those iterations at their
    top edge, and every line of every panel is labelled in its panel's legend."""
    from megaloop.eval.run_plot import draw_run, read_run

    nan, inf = float("nan"), float("inf")
    losses = [3.0, 2.9, nan, inf, None, None]
    grads = [1.0, 1.1, nan, None, None, None]
    lines = []
    for i, (loss, grad) in enumerate(zip(losses, grads), start=1):
        lines.append({"iteration": i, "split": "train", "loss": loss,
                      "step_losses": [loss, loss], "exit_probs": [0.5, 0.5], "p0": 0.5,
                      "p0_collapse_iters": 0, "grad_norm": grad, "skipped_iters": max(i - 2, 0),
                      "lr": 1e-3, "tokens_per_sec": 100.0, "mem_gib": 1.0, "loss_spikes": 0})
    lines.append({"iteration": 4, "split": "valid", "loss": None, "step_losses": [None, None]})
    log = tmp_path / "diverged.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n")  # NaN and Infinity as json
    fig, _ = draw_run(read_run(str(log)))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    for ax in fig.axes:
        owner = next(p for p in panels.values() if p.bbox.bounds == ax.bbox.bounds)
        legend = owner.get_legend()
        shown = [t.get_text() for t in legend.get_texts()] if legend else []
        for line in ax.get_lines():
            assert not line.get_label().startswith("_"), (owner.get_title(), line.get_label())
            assert line.get_label() in shown, (owner.get_title(), line.get_label(), shown)

    def marks(panel, label):
        (line,) = [x for x in panels[panel].get_lines() if x.get_label() == label]
        return list(line.get_xdata())

    assert marks("loss", "train loss non-finite (4)") == [3, 4, 5, 6]
    assert marks("loss", "valid loss non-finite (1)") == [4]
    assert marks("gradient norm", "grad norm non-finite (4)") == [3, 4, 5, 6]
    assert marks("loss", "train objective") == [1, 2]  # the finite points stay a line


def test_trainer_window_counts_the_evaluations_before_the_checkpoint():
    """By hand, for --eval-interval 100 and --train-iters 300: the trainer evaluates at 100, 200
    and at the end (300), each reading the next window; a checkpoint at 150 was not evaluated
    (its next evaluation, at 200, reads window 1); a run with --eval-iters 0 read none."""
    from megaloop.eval.data import trainer_window

    training = {"eval_interval": 100, "eval_iters": 2, "train_iters": 300}
    assert [trainer_window(training, s) for s in (1, 100, 150, 200, 300)] == [0, 0, 1, 1, 2]
    assert trainer_window(training, None) == 0  # an exported folder
    assert trainer_window({**training, "eval_iters": 0}, 300) == 0
