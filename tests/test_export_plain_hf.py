"""An export-hf folder used by plain `transformers`, in a process that cannot import megaloop.

A tiny looped model with a sentencepiece tokenizer trained here is saved as a checkpoint and
exported by ``export_hf`` under umask 077. EOD is planted in the greedy continuation: the output
layer's rows of EOD and of X are swapped, X being the first token of the model's own greedy
continuation, from its fourth on, that it has not produced before; so greedy decoding reaches
EOD exactly where it would have produced X (megaloop's own Generator, stopping at EOD, computes
the expected ids).

A subprocess started without the repository on sys.path (python -S with only the packages'
folder added: no editable-install hook either) loads the folder with AutoTokenizer and
AutoModelForCausalLM(trust_remote_code=True): the prompt's ids equal megaloop's tokenization,
greedy generate() returns megaloop's continuation and stops at EOD before max_new_tokens (from
config.json / generation_config.json alone), and the prompt decodes back to its text.
"""

import json
import os
import stat
import subprocess
import sys
import textwrap

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
    # Trimmed to the tokenizer's ids: a random model's padding rows would win argmax.
    export_hf(ckpt, os.path.join(tmp, "deep", "hf"), vocab_size=tok.vocab_size)
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
