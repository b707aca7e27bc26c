"""Every recipe in examples/recipes/, full size and CPU size, prints flags that parse and pass
RunConfig.validate(), so a renamed or removed flag breaks this test, not a cluster job."""

import os
import subprocess
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
SCRIPTS = sorted(p for p in RECIPES.glob("*.sh") if not p.name.startswith(("_", "make_")))


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
