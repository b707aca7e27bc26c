"""Every recipe in examples/recipes/, full size and CPU size, prints flags that parse and pass
RunConfig.validate(), so a renamed or removed flag breaks this test, not a cluster job."""

import os
import subprocess
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
# The recipes that take (DATA_PREFIX, TOKENIZER_MODEL); the Ouro, Nanbeige and Huginn ones take a
# Hugging Face folder first (test_hf_recipe_flags_parse_and_validate; tests/test_ouro_recipes.py
# and its siblings run them).
SCRIPTS = sorted(p for p in RECIPES.glob("*.sh")
                 if not p.name.startswith(("_", "make_", "ouro_", "nanbeige", "huginn_")))
# recipe -> (entry point, the model's loop steps, whether it has an exit gate)
HF_RECIPES = {"ouro_1.4b_sft": ("pretrain", 4, True), "ouro_1.4b_rltt": ("rl", 4, True),
              "nanbeige4.2_3b_sft": ("pretrain", 2, False),
              "nanbeige4.2_3b_rltt": ("rl", 2, False),
              "huginn_0125_sft": ("pretrain", 32, False), "huginn_0125_rltt": ("rl", 32, False)}


def recipe_args(script: Path, size: str, data: str, tokenizer: str, **env) -> list[str]:
    env = {**os.environ, "SIZE": size, "PRINT_ARGS": "1", **env}
    out = subprocess.run(["bash", str(script), data, tokenizer], env=env, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def test_recipes_exist():
    names = {p.stem for p in SCRIPTS}
    assert {"looplm_1.4b", "dense_24l", "dense_72l", "coreloop_003"} <= names


@pytest.mark.parametrize("size,world", [("full", 8), ("cpu", 1)])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_recipe_flags_parse_and_validate(script, size, world, tmp_path):
    from megaloop.training.run_config import parse_args

    import numpy

    from megaloop.data.indexed_format import IndexedWriter

    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_text("")  # validate() checks that the path exists, not its contents
    # validate() reads the .idx header against the .bin: a real (tiny) dataset.
    writer = IndexedWriter(str(tmp_path / "corpus_text_document.bin"), numpy.uint16)
    writer.add_documents(numpy.arange(6), numpy.array([2, 4]))
    writer.finalize(str(tmp_path / "corpus_text_document.idx"))
    # The loss-mask twin that --data-format sft (the mid-training recipe) reads too.
    writer = IndexedWriter(str(tmp_path / "corpus_lossmask_document.bin"), numpy.uint8)
    writer.add_documents(numpy.ones(6, numpy.uint8), numpy.array([2, 4]))
    writer.finalize(str(tmp_path / "corpus_lossmask_document.idx"))
    # A stage that starts from a checkpoint (--finetune) is validated against one that exists.
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    (pretrained / "latest_checkpointed_iteration.txt").write_text("1")
    args = recipe_args(script, size, str(tmp_path / "corpus_text_document"), str(tokenizer),
                       PRETRAINED=str(pretrained))
    cfg = parse_args(args)
    cfg.validate(world_size=world)
    assert cfg.data.data_path == [str(tmp_path / "corpus_text_document")]
    # The recipes' defining switches (a silently dropped flag would still parse).
    if script.stem == "looplm_1.4b":
        assert (cfg.loop.num_loops, cfg.model.norm_scheme, cfg.loop.exit_kl_beta) == (4, "ouro", 0.15)
        assert cfg.optim.lr_warmup_iters > 0 and cfg.optim.lr_decay_style == "cosine"
    if script.stem.startswith("dense"):
        assert cfg.loop.num_loops == 1
    if script.stem == "looplm_1.4b_midtrain":  # the pretraining recipe's model, new stage
        assert (cfg.loop.num_loops, cfg.model.norm_scheme) == (4, "ouro")
        assert cfg.loop.exit_kl_beta == 0.15
        assert cfg.data.data_format == "sft" and cfg.checkpoint.finetune
        assert cfg.optim.lr_warmup_iters > 0 and cfg.optim.lr_decay_style == "cosine"
    if script.stem == "coreloop_003":
        assert cfg.loop.history_injection == "channel-wise" and cfg.loop.history_window == 2
        assert cfg.loop.timestep_conditioning == "loop-gating"
        assert cfg.loop.num_prelude_layers > 0 and cfg.loop.num_coda_layers > 0
        assert cfg.optim.optimizer == "muon"
    if size == "full":
        layers = {"looplm_1.4b": 24, "dense_24l": 24, "dense_72l": 72,
                  "looplm_1.4b_midtrain": 24}
        if script.stem in layers:
            assert cfg.model.num_layers == layers[script.stem]
            assert (cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (2048, 5632)


@pytest.mark.parametrize("nodes,world", [("1", 8), ("4", 32)])
@pytest.mark.parametrize("name", sorted(HF_RECIPES))
def test_hf_recipe_flags_parse_and_validate(name, nodes, world, tmp_path):
    """Both layouts of the Ouro, Nanbeige and Huginn recipes at full size give flags the entry
    point parses and validates at that world size, with the paper's RL settings and the layout's
    TP size (and Huginn's training recurrence, read from its config.json)."""
    kind, loops, gated = HF_RECIPES[name]
    from megaloop.rl.config import parse_args as parse_rl
    from megaloop.training.run_config import parse_args

    imported = tmp_path / "imported"
    (imported / "tokenizer").mkdir(parents=True)
    (imported / "latest_checkpointed_iteration.txt").write_text("0")
    problems = tmp_path / "gsm8k.jsonl"
    problems.write_text("")
    (tmp_path / "hf_folder").mkdir()  # the Huginn recipe reads its sampler's keys here
    (tmp_path / "hf_folder" / "config.json").write_text(
        '{"mean_recurrence": 32, "mean_backprop_depth": 8}')
    data = str(tmp_path / "corpus_text_document")
    env = {**os.environ, "SIZE": "full", "NODES": nodes, "PRINT_ARGS": "1",
           "IMPORTED": str(imported)}
    second = str(problems) if kind == "rl" else data
    args = subprocess.run(["bash", str(RECIPES / f"{name}.sh"), str(tmp_path / "hf_folder"),
                           second], env=env, check=True, capture_output=True,
                          text=True).stdout.splitlines()
    cfg = (parse_rl if kind == "rl" else parse_args)(args)
    tp = 1 if nodes == "1" else 2
    assert cfg.parallel.tensor_model_parallel_size == tp
    assert cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load == str(imported)
    assert cfg.tokenizer.tokenizer_model == str(imported / "tokenizer")
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.0)
    if kind == "rl":
        rl = cfg.rl
        assert (rl.objective, rl.temperature, rl.group_size, rl.prompts_per_step) == \
            ("rltt", 0.9, 8, 32)
        assert (cfg.optim.lr, cfg.training.train_iters) == (1e-5, 140)
        # The RL checks that need the world size: prompts split over DP, micro-batches.
        rl.validate(num_loops=loops, gated=gated, dp_size=world // tp,
                    micro_batch_size=cfg.training.micro_batch_size)
    else:
        import numpy

        from megaloop.data.indexed_format import IndexedWriter

        writer = IndexedWriter(data + ".bin", numpy.uint16)
        writer.add_documents(numpy.arange(6), numpy.array([2, 4]))
        writer.finalize(data + ".idx")
        mask = str(tmp_path / "corpus_lossmask_document")  # the twin --data-format sft reads
        writer = IndexedWriter(mask + ".bin", numpy.uint8)
        writer.add_documents(numpy.ones(6, numpy.uint8), numpy.array([2, 4]))
        writer.finalize(mask + ".idx")
        assert cfg.data.data_format == "sft" and cfg.checkpoint.finetune
        if name.startswith("huginn"):
            assert (cfg.loop.random_depth_mean, cfg.loop.random_depth_sigma,
                    cfg.loop.backprop_last_steps) == (32.0, 0.5, 8)
            cfg.loop.num_loops, cfg.loop.exit_loss = 32, "last"  # (taken from Huginn's import)
        # What --use-checkpoint-args takes from an imported Ouro-1.4B (65536 positions) before
        # validation; this test's checkpoint folder is empty.
        cfg.model.max_position_embeddings = 65536
        cfg.validate(world_size=world)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_print_args_command_is_one_pasteable_line(script, tmp_path):
    """PRINT_ARGS=command prints the launch as one shell-quoted line: the shell reads it back as
    torchrun on pretrain_looplm.py with exactly PRINT_ARGS=1's flags, a value with a space or a
    quote included. (The mid-training recipe prints a command only once the pretraining
    checkpoint it loads exists: a folder standing for it is given.)"""
    import shlex

    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    (pretrained / "latest_checkpointed_iteration.txt").write_text("10")
    data, tokenizer, extra = "demo/corpus_text_document", "tok dir/it's.model", ["--seed", "7"]
    stage = {"PRETRAINED": str(pretrained), "SAVE_DIR": str(tmp_path / "save")}
    want = recipe_args(script, "cpu", data, tokenizer, **stage)
    env = {**os.environ, "SIZE": "cpu", "PRINT_ARGS": "command", "PYTHON": "/opt/py thon",
           **stage}
    out = subprocess.run(["bash", str(script), data, tokenizer, *extra], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert len(out.splitlines()) == 1, out
    words = shlex.split(out)
    root = str(RECIPES.parent.parent)
    assert words[:6] == [f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}",
                         "/opt/py thon", "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    assert words[6] == os.path.join(root, "pretrain_looplm.py")
    assert words[7:] == want + extra
