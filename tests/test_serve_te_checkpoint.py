"""A checkpoint whose run config says ``transformer_impl: transformer_engine`` (Megatron-LM's
default, so every checkpoint trained without the flag, on CPU too) is generated from and served
on a GPU node with Transformer Engine installed: tools/generate.py and tools/serve.py build the
local layers (``--transformer-impl`` defaults to them; the server runs nothing else),
say so in one line that names the saved flag (not the layers its run built, which are not
recorded; on CPU, where the flag builds the local layers too, nothing is said), and give the
greedy tokens of the model as saved, decoded independently by full forwards of the in-memory
model. Forcing what an entry point cannot run is refused by name.

"A GPU node with TE" is the answer ``megaloop.model.config.use_transformer_engine`` gives there
(every backend but `local` is Transformer Engine's); nothing else of the machine is imitated,
and this venv has no Transformer Engine, so a load that still built the saved backend fails.
That the tensor names of both backends map onto each other is shown with Transformer Engine's
modules themselves in tests/test_te_mapping.py.
"""

import contextlib
import dataclasses
import io
import os
import sys

import pytest
import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style
from run_helpers import load_tool as _tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = 256  # embedding rows (a multiple of 128: no padding)
V = 200  # the null tokenizer's ids before EOD; EOD = V
PROMPTS = [[5, 6, 7, 8], [9, 10]]
MAX_TOKENS = 8
# The line names the saved flag, never the layers the saving run built: it does not record them
# (this checkpoint's were local, trained as on CPU).
NOTE = "with --transformer-impl local: the checkpoint's run config says --transformer-impl " \
       "transformer_engine, which builds Transformer Engine's layers on a GPU and the local " \
       "ones on CPU (which its run built is not recorded); either's weights map onto local's " \
       "by name"
# Run a tool as on a GPU node with Transformer Engine installed: the layer-backend decision
# answers as it does there, then the tool runs as __main__ with the rest of the command line.
GPU_NODE = ("import runpy, sys; import megaloop.model.config as c; "
            "c.use_transformer_engine = lambda m: m.transformer_impl != 'local'; "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _on_gpu_node(model_cfg) -> bool:
    return model_cfg.transformer_impl != "local"


def _greedy(model, prompt, max_tokens, eod):
    """Greedy continuation by a full forward per token (no cache, no batching), stopping after
    EOD: what any decode path of the same weights must give."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            x = torch.tensor([ids])
            logits = model(x, torch.arange(len(ids)).unsqueeze(0), None)
            token = int(logits[0, -1, :eod + 1].argmax())
            out.append(token)
            ids.append(token)
            if token == eod:
                break
    return out


def _save(rank, world, save):
    """A checkpoint trained on CPU without --transformer-impl: the run config says
    transformer_engine, the weights are the local layers'. Every parameter is drawn at random
    (norm scales included, so norms swapped by a wrong name map would show). Returns the
    independent greedy continuations of PROMPTS."""
    from megaloop.checkpoint.save import save_weights
    from megaloop.data.config import TokenizerConfig
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(1)
    model_cfg = llama_style(num_layers=3, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=64)
    assert model_cfg.transformer_impl == "transformer_engine"  # Megatron-LM's default
    loop = LoopConfig(num_loops=3, num_prelude_layers=1)
    # The local layers on any machine (a GPU one too), the run config as saved without the flag.
    model = build_model(dataclasses.replace(model_cfg, transformer_impl="local"), loop, TABLE,
                        tp_size=1)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.eval()
    run = {"model": dataclasses.asdict(model_cfg), "loop": dataclasses.asdict(loop),
           "tokenizer": dataclasses.asdict(TokenizerConfig("NullTokenizer", None, V))}
    save_weights(save, 1, model, run_config=run)
    return [_greedy(model, p, MAX_TOKENS, V) for p in PROMPTS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, the greedy continuations of the model as saved)."""
    path = str(tmp_path_factory.mktemp("te_config") / "ckpt")
    return path, run_distributed(_save, 1, path)[0]


def _run_tool(rank, world, name, argv):
    """(exit code, stdout, stderr) of tools/<name>.py's main in this rank."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _tool(name).main(argv)
    return code, out.getvalue(), err.getvalue()


def test_saved_run_config_says_transformer_engine(saved):
    from megaloop.checkpoint.config import read_run_config

    assert read_run_config(saved[0])["model"]["transformer_impl"] == "transformer_engine"


def test_generate_on_a_gpu_node_builds_the_local_layers(saved, monkeypatch):
    """tools/generate.py without --transformer-impl: the local layers (one line says so), the
    tokens of the model as saved."""
    import megaloop.model.config

    monkeypatch.setattr(megaloop.model.config, "use_transformer_engine", _on_gpu_node)
    path, want = saved
    argv = ["--load", path, "--max-tokens", str(MAX_TOKENS)]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    code, out, err = run_distributed(_run_tool, 1, "generate", argv)[0]
    assert code == 0, err
    assert [f"generating {NOTE}"] == [x for x in err.splitlines() if NOTE in x]
    assert [[int(t) for t in line.split(",")] for line in out.strip().splitlines()] == want


def test_generate_on_cpu_claims_no_transformer_engine_layers(saved):
    """On this machine (no GPU) the saved flag builds the local layers too, which the tool
    builds: the checkpoint's generation prints no line about the backend, and nothing that says
    it was saved with Transformer Engine's layers (it was trained on CPU: its layers were
    local)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the saved flag builds Transformer Engine's layers: the line is due")
    path, want = saved
    argv = ["--load", path, "--max-tokens", str(MAX_TOKENS)]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    code, out, err = run_distributed(_run_tool, 1, "generate", argv)[0]
    assert code == 0, err
    assert "transformer" not in err.lower() and "saved with" not in err, err
    assert [[int(t) for t in line.split(",")] for line in out.strip().splitlines()] == want


def _exported(rank, world, load, out):
    from megaloop.convert.hf_export import export_hf

    setup_parallel(1)
    export_hf(load, out)


def test_generate_from_an_export_on_a_gpu_node(saved, monkeypatch, tmp_path):
    """A folder written by export-hf names no backend: it loads into the local layers too."""
    import megaloop.model.config

    path, want = saved
    folder = str(tmp_path / "hf")
    run_distributed(_exported, 1, path, folder)  # (on this machine: the local layers)
    monkeypatch.setattr(megaloop.model.config, "use_transformer_engine", _on_gpu_node)
    argv = ["--load", folder, "--max-tokens", str(MAX_TOKENS), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(V)]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    code, out, err = run_distributed(_run_tool, 1, "generate", argv)[0]
    assert code == 0, err
    assert [[int(t) for t in line.split(",")] for line in out.strip().splitlines()] == want


def test_forced_backends_are_refused_by_name(saved, capsys):
    """Before any model is loaded (no process group starts): the server of
    tools/serve.py does not run Transformer Engine's attention; this machine has no GPU for
    tools/generate.py's; an unknown value is named with the choices."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    path = saved[0]
    assert _tool("serve").main(["--load", path, "--transformer-impl", "transformer_engine"]) == 2
    err = capsys.readouterr().err
    assert "--transformer-impl transformer_engine: the server batches rows" in err
    assert "leave the flag out" in err
    if not torch.cuda.is_available():
        code = _tool("generate").main(["--load", path, "--prompt-ids", "5,6",
                                       "--transformer-impl", "transformer_engine"])
        assert code == 2
        assert "--transformer-impl transformer_engine: its kernels need a GPU" in \
            capsys.readouterr().err
    code = _tool("generate").main(["--load", path, "--prompt-ids", "5,6",
                                   "--transformer-impl", "te"])
    assert code == 2
    assert "--transformer-impl te: choose one of local, transformer_engine" in \
        capsys.readouterr().err


def test_serve_on_a_gpu_node_builds_the_local_layers(saved, tmp_path):
    """tools/serve.py (a real server process, run as on a GPU node with TE) serves the checkpoint
    with the local layers, says so in one line, and answers the model's greedy tokens."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from test_serve import serving

    path, want = saved
    log = str(tmp_path / "server.log")
    with serving(path, [], log, launcher=(sys.executable, "-c", GPU_NODE)) as (client, _):
        r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
    for text, ids in zip(texts, want):
        # (the server does not return the end-of-document token's text)
        assert [int(x) for x in text.split()] == (ids[:-1] if ids[-1] == V else ids)
    lines = open(log).read().splitlines()
    assert [f"serving {NOTE}"] == [x for x in lines if NOTE in x]
