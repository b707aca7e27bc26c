"""The two post-training studies of examples/studies at --size tiny: midtrain.py (mid-training
against continued pretraining) end to end, its table and figure, and what the table claims
checked against the runs themselves:

- both second-stage arms start at iteration 1 of their own schedule and see the same number of
  samples, the mid-trained one on the SFT data (its saved run config), the other on the corpus;
- the held-out corpus loss of each row (before, mid-trained, continued) equals the loss computed
  here from that row's checkpoint: loaded by megaloop.checkpoint.load, the held-out documents cut
  into windows, cross-entropy of the last loop step's log-softmax written out; the three
  checkpoints' losses differ, so a row showing another checkpoint's number fails.

and rl.py (GRPO against RLTT with exit_pdf weights through train_rl.py) from those mid-trained
checkpoints: its choice of problems on hand-made accuracies; each arm's RL checkpoint names its
seed's mid-trained checkpoint as the frozen reference and carries the arm's objective and loop
weighting; its training prompts and held-out problems are the chosen (family, k) cells, the
held-out ones disjoint from the training prompts and from the mid-training study's held-out set.

Whether mid-training or RL helps is for the cpu-size results (examples/studies/results/
midtrain.md, rl.md), not for this test.
"""

import importlib.util
import json
import os
import re
import sys

import pytest

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "studies"))


def load_script(name):
    spec = importlib.util.spec_from_file_location(
        f"study_{name}", os.path.join(ROOT, "examples", "studies", f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def midtrain(tmp_path_factory):
    out = tmp_path_factory.mktemp("posttrain")
    script = load_script("midtrain")
    assert script.main(["--size", "tiny", "--output-dir", str(out)]) == 0
    return script, out


def _held_out_losses(rank, world, ckpts, tokenizer, docs_path, seq, windows, depth):
    """Cross-entropy at loop step ``depth`` of each checkpoint on the first ``windows`` windows
    of seq + 1 tokens of the documents (joined by EOD), computed here."""
    import torch
    import torch.nn.functional as F

    from megaloop.checkpoint.load import load_model
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.model import recurrence
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(), 1)
    losses = []
    for ckpt in ckpts:
        model = load_model(ckpt)[0].eval()
        tok = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer))
        stream = []
        for line in open(docs_path):
            stream += tok.tokenize(json.loads(line)["text"]) + [tok.eod]
        rows = torch.tensor(stream[:windows * (seq + 1)]).view(windows, seq + 1)
        x, y = rows[:, :-1], rows[:, 1:]
        pos = torch.arange(seq).expand_as(x)
        with torch.no_grad():
            ctx = recurrence.context(model, x, None, None, depth, read_every_step=False)
            # [b, s, rows]: every output row, as the trainer's cross-entropy reads them
            logits = recurrence.fold(model, recurrence.begin(model, x, pos, ctx), ctx).float()
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          y.reshape(-1)).item())
    return losses


def test_midtrain_study_writes_its_table_and_figure(midtrain):
    _, out = midtrain
    md = (out / "studies" / "midtrain.md").read_text()
    for needle in ["| checkpoint | held-out corpus loss | accuracy | k=1 |",
                   "| comparison | held-out corpus loss | accuracy | k=1 |",
                   "| before (pretrained) |", "| mid-trained (SFT) |", "| continued pretraining |",
                   "| mid-trained (SFT) - continued pretraining |", "## Accuracy by task family",
                   "| depth | accuracy | k=1 |", "--data-format sft", "--finetune",
                   "Verdicts: a difference is *beyond spread* when"]:
        assert needle in md, f"midtrain.md lacks {needle!r}:\n{md}"
    assert "nan" not in md
    with open(out / "studies" / "midtrain.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_midtrain_arms_see_the_same_samples_from_iteration_one(midtrain):
    script, out = midtrain
    runs = out / "runs" / "midtrain"
    gbs = 4  # the tiny size's global batch

    def train_records(arm):
        path = runs / arm / "seed_1234" / "train.jsonl"
        return [r for r in map(json.loads, open(path)) if r["split"] == "train"]

    mid, cont = train_records("looped_1_x_2_mid_trained__sft"), \
        train_records("looped_1_x_2_continued_pretraining")
    stage = script.STAGE["tiny"]
    for records in (mid, cont):
        assert records[-1]["iteration"] == stage
        # a fresh schedule: iteration i has consumed i global batches (not the pretraining's)
        assert all(r["consumed_samples"] == r["iteration"] * gbs for r in records)
    from megaloop.checkpoint.config import read_run_config

    # what each run trained on, as its checkpoint's saved configuration says
    data = {arm: read_run_config(str(runs / arm / "seed_1234" / "ckpt"))["data"]
            for arm in ("looped_1_x_2_mid_trained__sft", "looped_1_x_2_continued_pretraining")}
    assert (data["looped_1_x_2_mid_trained__sft"]["data_path"],
            data["looped_1_x_2_mid_trained__sft"]["data_format"]) == (
        [str(out / "data" / "midtrain_sft_text_document")], "sft")
    assert (data["looped_1_x_2_continued_pretraining"]["data_path"],
            data["looped_1_x_2_continued_pretraining"]["data_format"]) == (
        [str(out / "data" / "corpus_text_document")], "pretrain")


def test_midtrain_corpus_loss_of_each_row_is_that_checkpoints(midtrain):
    script, out = midtrain
    md = (out / "studies" / "midtrain.md").read_text()
    table = md.split("## Held-out accuracy by k")[1].split("## Differences")[0]
    shown = {}
    for arm in (script.BEFORE, script.MID, script.CONT):
        row = re.search(rf"^\| {re.escape(arm)} \| ([0-9.]+) \|", table, re.M)
        shown[arm] = float(row.group(1))
    runs = out / "runs" / "midtrain"
    ckpts = [str(runs / d / "seed_1234" / "ckpt") for d in (
        "looped_1_x_2_pretrained", "looped_1_x_2_mid_trained__sft",
        "looped_1_x_2_continued_pretraining")]
    from study import SIZES

    tiny = SIZES["tiny"]
    K, T = script.SHAPE["tiny"]
    losses = run_distributed(_held_out_losses, 1, ckpts, str(out / "data" / "tokenizer.model"),
                             str(out / "data" / "midtrain_heldout_docs.jsonl"), tiny["seq"],
                             tiny["eval_iters"] * tiny["gbs"], T)[0]
    for arm, loss in zip(shown, losses):
        assert shown[arm] == pytest.approx(loss, abs=6e-4), (arm, shown, losses)
    # the three differ by more than the table's rounding: a row with another's number fails
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1:]) > 2e-3


def test_rl_problem_choice_on_hand_made_accuracies():
    rl = load_script("rl")

    def ev(cells):  # a depth_sweep.json with the trained depth 4 only
        by_family = {}
        for (family, k), acc in cells.items():
            by_family.setdefault(family, {})[str(k)] = acc
        return {"depths": [{"depth": 4, "tasks": {"by_family": by_family}}]}

    # two seeds; means: a k=1 0.8, a k=2 0.4, a k=3 0.25, b k=1 0.5, b k=2 0.1
    evals = [ev({("a", 1): 0.9, ("a", 2): 0.5, ("a", 3): 0.2, ("b", 1): 0.5, ("b", 2): 0.1}),
             ev({("a", 1): 0.7, ("a", 2): 0.3, ("a", 3): 0.3, ("b", 1): 0.5, ("b", 2): 0.1})]
    family, ks, means, inside = rl.pick_problems(evals, 4)
    assert (family, ks, inside) == ("a", [2, 3], True)  # a has two k in 20-60%, b one
    assert means[("a", 3)] == pytest.approx(0.25)
    # nothing in range: the cell closest to 40%
    evals = [ev({("a", 1): 0.9, ("b", 1): 0.1, ("b", 2): 0.15})]
    assert rl.pick_problems(evals, 4)[::3] == ("b", False)
    assert rl.pick_problems(evals, 4)[1] == [2]


@pytest.fixture(scope="module")
def rl_study(midtrain):
    _, out = midtrain  # the same folder: the mid-training runs are reused
    script = load_script("rl")
    assert script.main(["--size", "tiny", "--output-dir", str(out)]) == 0
    return script, out


def test_rl_study_starts_each_seed_from_its_midtrained_checkpoint(rl_study):
    from megaloop.checkpoint.format import read_common
    from megaloop.checkpoint.tracker import resolve

    script, out = rl_study
    md = (out / "studies" / "rl.md").read_text()
    for needle in ["| checkpoint | held-out accuracy | vs before RL | gain per seed | reward mean "
                   "| solve rate | groups with equal rewards | KL to the reference (k3) | "
                   "gradient norm |", "| mid-trained (before RL) |", "| GRPO |",
                   "| RLTT (exit_pdf) |", "| RLTT (exit_pdf) - GRPO |",
                   "Verdicts: a difference is *beyond spread* when"]:
        assert needle in md, f"rl.md lacks {needle!r}:\n{md}"
    assert "nan" not in md
    with open(out / "studies" / "rl.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    mid = out / "runs" / "midtrain" / "looped_1_x_2_mid_trained__sft" / "seed_1234" / "ckpt"
    wanted = {"grpo": ("grpo", None), "rltt__exit_pdf": ("rltt", "exit_pdf")}
    for arm, (objective, weighting) in wanted.items():
        run = out / "runs" / "rl" / arm / "seed_1234"
        common = read_common(resolve(str(run / "ckpt"), None))
        reference = common["extra"]["rl_reference"]
        assert reference["kind"] == "checkpoint"
        assert os.path.dirname(reference["path"]) == str(mid)
        rl = common["run_config"]["rl"]
        assert (rl["objective"], rl["loop_weighting"]) == (objective, weighting)
        records = [json.loads(line) for line in open(run / "train.jsonl")]
        assert [r["iteration"] for r in records] == list(
            range(1, script.RL["tiny"]["steps"] + 1))


def test_rl_problems_are_the_chosen_cells_and_held_out(rl_study):
    script, out = rl_study
    data = out / "data"
    evals = [json.load(open(out / "runs" / "midtrain" / "looped_1_x_2_mid_trained__sft"
                            / "seed_1234" / "eval" / "depth_sweep.json"))]
    family, ks, _, _ = script.pick_problems(evals, script.midtrain.SHAPE["tiny"][1])
    tag = f"{family}_{'_'.join(map(str, ks))}"
    read = [json.loads(line) for line in open(data / f"rl_train_{tag}.jsonl")]
    held = [json.loads(line) for line in open(data / f"rl_heldout_{tag}.jsonl")]
    sizes = script.RL["tiny"]
    for items, per_k in ((read, sizes["train"]), (held, sizes["heldout"])):
        assert {(t["family"], t["k"]) for t in items} == {(family, k) for k in ks}
        assert len(items) == per_k * len(ks)
    others = {t["question"] for t in map(json.loads, open(data / "tasks.jsonl"))}
    assert not {t["question"] for t in held} & ({t["question"] for t in read} | others)
