"""An export-hf folder used by plain `transformers`, in a process that cannot import megaloop.

A tiny looped model with a sentencepiece tokenizer trained here is saved as a checkpoint and
exported by ``export_hf`` under umask 077. EOD is planted in the greedy continuation: the output
layer's rows of EOD and of X are swapped, X being the first token of the model's own greedy
continuation, from its fourth on, that it has not produced before; so greedy decoding reaches
EOD exactly where it would have produced X (megaloop's own Generator, stopping at EOD, computes
the expected ids).

(The run's tokenizer file, moved after training, is refused by name, then passed as
``tokenizer_model``: export-hf's --tokenizer-model.)

A subprocess started without the repository on sys.path (python -S with only the packages'
folder added: no editable-install hook either) loads the folder with AutoTokenizer and
AutoModelForCausalLM(trust_remote_code=True): the prompt's ids equal megaloop's tokenization,
greedy generate() returns megaloop's continuation and stops at EOD before max_new_tokens (from
config.json / generation_config.json alone), and the prompt decodes back to its text.
"""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest

from distributed import run_distributed
from flags import llama_style

PROMPT = "the loop reads its own output again"
MAX_NEW = 12
CORPUS = ["the loop reads its own output again and again", "a looped model runs one block",
          "each step refines the state of every token", "exit early when the answer is ready",
          "numbers like 1234 and 56 are split into digits", "Tabs\tand  double  spaces too"]


def _export(rank, world, tmp):
    import torch

    from megaloop.convert.hf_export import export_hf
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer, train_sentencepiece
    from megaloop.inference.generate import Generator
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize
    from megaloop.training.checkpointing import save_checkpoint
    from megaloop.training.run_config import RunConfig

    os.umask(0o077)  # the export must still be readable by everyone
    initialize(ParallelConfig(), 3)
    model_file = train_sentencepiece(CORPUS * 20, os.path.join(tmp, "spm"), vocab_size=320)
    tok_cfg = TokenizerConfig("SentencePieceTokenizer", model_file)
    tok = build_tokenizer(tok_cfg)
    model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=32, untie_embeddings_and_output_weights=True)
    loop = LoopConfig(num_loops=3)
    model = build_model(model_cfg, loop, tok.vocab_size, tp_size=1).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a random model at init is nearly uniform: give it preferences
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    prompt = tok.tokenize(PROMPT)
    free = Generator(model, tok.vocab_size).generate([prompt], MAX_NEW)[0]
    k = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t != tok.eod)
    assert tok.eod not in free[:k], free
    weight = model.output_layer.weight  # untied: the input embeddings stay as they are
    with torch.no_grad():
        weight[[tok.eod, free[k]]] = weight[[free[k], tok.eod]]
    expected = Generator(model, tok.vocab_size, eod=tok.eod).generate([prompt], MAX_NEW)[0]
    assert expected == free[:k] + [tok.eod], (free, expected)  # the planting worked
    ckpt = os.path.join(tmp, "ckpt")
    run = RunConfig(model=model_cfg, loop=loop, tokenizer=tok_cfg)
    save_checkpoint(ckpt, 1, model, run_config=run.to_dict())
    # The run's tokenizer file moved away: refused by name, then found where it is now.
    moved = os.path.join(tmp, "moved.model")
    os.rename(model_file, moved)
    with pytest.raises(ValueError, match=re.escape(f"{model_file} is not on this machine: "
                                                   f"pass --tokenizer-model")):
        export_hf(ckpt, os.path.join(tmp, "deep", "hf"))
    # Trimmed to the tokenizer's ids: a random model's padding rows would win argmax.
    export_hf(ckpt, os.path.join(tmp, "deep", "hf"), vocab_size=tok.vocab_size,
              tokenizer_model=moved)
    return prompt, expected, tok.eod


PLAIN = textwrap.dedent("""
    import importlib.util, json, os, sys
    sys.path.append(SITE)  # the installed packages only: no repository, no editable hook
    assert importlib.util.find_spec("megaloop") is None, "megaloop is importable"
    assert REPO not in [os.path.abspath(p or ".") for p in sys.path], sys.path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # trust_remote_code=False: the tokenizer runs no code of the folder (transformers 5 reads
    # config.json first, which names remote code, and would ask whether to trust it).
    tok = AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)
    ids = tok(PROMPT, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False)[0].tolist()
    new = out[ids["input_ids"].shape[1]:]
    print(json.dumps({"prompt": ids["input_ids"][0].tolist(), "new": new,
                      "text": tok.decode(ids["input_ids"][0]),
                      "eos": tok.eos_token_id, "config_eos": model.config.eos_token_id}))
""")


def test_export_loads_and_stops_at_eod_in_plain_transformers(tmp_path):
    import transformers
    from transformers import TokenizersBackend  # noqa: F401  (imported once, before the fork)

    prompt, expected, eod = run_distributed(_export, 1, str(tmp_path))[0]
    folder = str(tmp_path / "deep" / "hf")
    for path in (str(tmp_path / "deep"), folder):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o755, path
    names = sorted(os.listdir(folder))
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors",
                            "modeling_megaloop.py", "configuration_megaloop.py",
                            "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                            "special_tokens_map.json"]), names
    for name in names:
        assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o644, name
    with open(os.path.join(folder, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == eod

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    values = {"SITE": os.path.dirname(os.path.dirname(transformers.__file__)), "REPO": repo,
              "FOLDER": folder, "PROMPT": PROMPT, "MAX_NEW": MAX_NEW}
    script = "".join(f"{k} = {v!r}\n" for k, v in values.items()) + PLAIN
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=str(tmp_path), env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prompt"] == prompt  # AutoTokenizer gives megaloop's ids
    assert got["eos"] == got["config_eos"] == eod
    assert got["new"] == expected and len(expected) < MAX_NEW  # stopped at EOD
    assert got["text"] == PROMPT  # and decodes it back


def _write_with_tokenizer(rank, world, out, tok_cfg):
    from megaloop.convert.hf_export import write_hf_folder
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(), 3)
    tok = build_tokenizer(tok_cfg)
    model_cfg = llama_style(num_layers=1, hidden_size=32, num_attention_heads=2)
    model = build_model(model_cfg, LoopConfig(), tok.vocab_size, tp_size=1)
    cfg = write_hf_folder(out, model_cfg, LoopConfig(), model.state_dict(), tokenizer=tok_cfg)
    return cfg, tok.tokenize(CORPUS[-2]), tok.eod, tok.pad


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_export_writes_tokenizers_library_tokenizers(kind, tmp_path):
    """A run's Hugging Face tokenizer.json (with the tokenizer_config.json naming its eos) and
    GPT-2 BPE files: AutoTokenizer reads the folder's tokenizer and gives megaloop's ids and EOD."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megaloop.data.config import TokenizerConfig

    src = tmp_path / "src"
    src.mkdir()
    specials = ["<unk>", "<pad>", "<|end|>"] if kind == "HuggingFaceTokenizer" else \
        ["<|endoftext|>"]
    hf = Tokenizer(models.BPE(unk_token=specials[0]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "HuggingFaceTokenizer":  # an eos name megaloop only finds through the config
        hf.save(str(src / "tokenizer.json"))
        (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
        tok_cfg = TokenizerConfig(kind, str(src))
    else:
        hf.model.save(str(src))  # vocab.json, merges.txt
        tok_cfg = TokenizerConfig(kind, vocab_file=str(src / "vocab.json"),
                                  merge_file=str(src / "merges.txt"))
    folder = str(tmp_path / "hf")
    cfg, ids, eod, pad = run_distributed(_write_with_tokenizer, 1, folder, tok_cfg)[0]
    got = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert got(CORPUS[-2])["input_ids"] == ids
    assert got.eos_token_id == cfg["eos_token_id"] == eod == hf.token_to_id(specials[-1])
    assert cfg["pad_token_id"] == (hf.token_to_id("<pad>") if pad >= 0 else eod)


def _write_failing_tokenizer(rank, world, out):
    import megaloop.convert.hf_tokenizer as hf_tokenizer
    from megaloop.convert.hf_export import write_hf_folder
    from megaloop.data.config import TokenizerConfig
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    def fails(*args, **kwargs):  # what a missing protobuf does to a sentencepiece conversion
        raise ImportError("no protobuf")

    hf_tokenizer.write_tokenizer_files = fails
    initialize(ParallelConfig(), 3)
    model_cfg = llama_style(num_layers=1, hidden_size=32, num_attention_heads=2)
    model = build_model(model_cfg, LoopConfig(), 64, tp_size=1)
    try:
        write_hf_folder(out, model_cfg, LoopConfig(), model.state_dict(),
                        tokenizer=TokenizerConfig("NullTokenizer", None, 63))
    except ImportError:
        return sorted(os.listdir(out))
    return None


def test_a_failing_tokenizer_conversion_writes_no_weights(tmp_path):
    """The tokenizer is converted before the weights are written: when it fails, no folder that
    looks like a finished export (model.safetensors, config.json) is left behind."""
    left = run_distributed(_write_failing_tokenizer, 1, str(tmp_path / "out"))[0]
    assert left is not None  # the failure reached the caller
    assert "model.safetensors" not in left and "config.json" not in left
