"""tools/serve.py end to end: a tiny trained checkpoint served by a real server subprocess on
127.0.0.1, asked with a real HTTP client. Greedy answers equal tools/generate.py's; concurrent
requests equal the sequential ones; echo + logprobs equal an independent log-softmax of the full
forward; malformed requests get a 4xx with a message and the server keeps serving."""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from distributed import free_port, run_distributed, setup_parallel  # noqa: E402
from test_inference import _generate_tool, _train_and_save  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOD = 200  # the null tokenizer of test_training.BASE: --vocab-size 200, EOD = 200


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("serve") / "ckpt")
    run_distributed(_train_and_save, 1, path)
    return path


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """(client, server log path) of a tools/serve.py subprocess, killed at the end."""
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("serve_log") / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "serve.py"), "--load", ckpt,
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{open(log_path).read()}")
            try:
                if client.get("/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready in 90 s:\n{open(log_path).read()}")
            time.sleep(0.2)
        yield client, log_path
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split()]  # the null tokenizer's text


def test_models(server):
    client, _ = server
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["ckpt"]


def test_greedy_ids_equal_generate_tool(server, ckpt, tmp_path):
    """Token-id prompts (one, and a batch of two of different lengths), greedy: the ids that
    tools/generate.py prints for the same prompts."""
    client, _ = server
    code, printed = run_distributed(
        _generate_tool, 1, ["--load", ckpt, "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
                            "--max-tokens", "12"], str(tmp_path / "gen"))[0]
    assert code == 0
    want = [[int(i) for i in line.split(",")] for line in printed.strip().split("\n")]
    one = _complete(client, model="ckpt", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    batch = _complete(client, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=12, temperature=0)
    assert one["object"] == "text_completion" and one["model"] == "ckpt"
    assert one["usage"] == {"prompt_tokens": 4, "completion_tokens": len(want[0]),
                            "total_tokens": 4 + len(want[0])}
    for choice, ids in zip([one["choices"][0]] + batch["choices"], [want[0]] + want):
        stopped = ids[-1] == EOD  # the server does not return the end-of-document token's text
        assert _ids(choice["text"]) == (ids[:-1] if stopped else ids)
        assert choice["finish_reason"] == ("stop" if stopped else "length")
        assert choice["logprobs"] is None
    assert [c["index"] for c in batch["choices"]] == [0, 1]


def test_text_prompt_echo_and_stop(server):
    client, _ = server
    by_ids = _complete(client, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    text = by_ids["choices"][0]["text"]
    by_text = _complete(client, prompt="5 6 7 8", max_tokens=6, temperature=0)
    assert by_text["choices"][0]["text"] == text
    echoed = _complete(client, prompt="5 6 7 8", max_tokens=6, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == "5 6 7 8" + text
    stop = text.split()[1]  # a string that occurs in the text: cut before its first occurrence
    cut = _complete(client, prompt=["5 6 7 8"], max_tokens=6, temperature=0, stop=[stop, "zz"])
    assert cut["choices"][0]["text"] == text[:text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_equal_sequential(server):
    client, log_path = server
    bodies = [dict(prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=2),
              dict(prompt="9 10 11", max_tokens=6, temperature=0.9, top_k=20, seed=3),
              dict(prompt=[[12, 13], [14, 15, 16]], max_tokens=5, temperature=0),
              dict(prompt=[17, 18, 19, 20, 21], max_tokens=0, echo=True, logprobs=1)]
    sequential = [_complete(client, **b)["choices"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        concurrent_ = list(pool.map(lambda b: _complete(client, **b)["choices"], bodies * 2))
    assert concurrent_ == sequential * 2
    lines = [x for x in open(log_path).read().splitlines() if "POST /v1/completions 200" in x]
    assert len(lines) >= 12  # one log line per request


def _reference_log_probs(rank, world, ckpt, ids):
    """log_softmax of the full forward's logits (no cache), over the tokenizer's vocabulary."""
    from megaloop.inference.loading import load_for_generation

    setup_parallel(world)
    model, tokenizer, _ = load_for_generation(ckpt)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x, torch.arange(len(ids)).unsqueeze(0), None)
    return torch.log_softmax(logits[0, :, :tokenizer.vocab_size].float(), -1).cpu()


def test_echo_logprobs_equal_full_forward(server, ckpt):
    """What lm-evaluation-harness's local-completions sends for log-likelihoods: echo, logprobs
    and max_tokens 0 (or 1, the generated token dropped)."""
    client, _ = server
    ids = [5, 17, 42, 9, 120, 7, 3, 88]
    ref = run_distributed(_reference_log_probs, 1, ckpt, ids)[0]  # [len, V]
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    for max_tokens in (0, 1):
        choice = _complete(client, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True,
                           logprobs=3)["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
        for j in range(1, len(ids)):
            top = lp["top_logprobs"][j]
            assert 3 <= len(top) <= 4  # the top 3 and the prompt's own token
            assert abs(max(top.values()) - ref[j - 1].max().item()) < 1e-5
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(len(ids)
                                                                                  + max_tokens)]
        if max_tokens:  # the greedy token's log-prob: the best of the last position's row
            assert abs(lp["token_logprobs"][-1] - ref[-1].max().item()) < 1e-5


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    client, _ = server
    bad = [{"max_tokens": 4},                                     # no prompt
           {"prompt": [5, 6], "max_tokens": -1},
           {"prompt": [5, 10 ** 6], "max_tokens": 2},             # outside the vocabulary
           {"prompt": {"text": "5"}, "max_tokens": 2},            # wrong types
           {"prompt": [5, 6], "max_tokens": "many"},
           {"prompt": [5, 6], "temperature": "hot"},
           {"prompt": [], "max_tokens": 2},
           {"prompt": "5", "model": "another-model"},
           {"prompt": [5, 6], "max_tokens": 1000}]                # past the context length
    for body in bad:
        r = client.post("/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert r.json()["error"]["message"], body
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert "vocabulary" in client.post("/v1/completions", json=bad[2]).json()["error"]["message"]
    good = _complete(client, prompt=[5, 6], max_tokens=3, temperature=0)
    assert len(_ids(good["choices"][0]["text"])) <= 3


def test_serve_refuses_a_torchrun_launch(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("serve_tool",
                                                  os.path.join(ROOT, "tools", "serve.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert tool.main(["--load", "nowhere", "--port", "1"]) == 2
    assert "not supported yet" in capsys.readouterr().err


def test_out_of_range_requests_are_refused_as_generate_refuses_them(server):
    """The server's requests go through the range checks of tools/generate.py's flags
    (megaloop/inference/flags.py): the same words, with the request's field names."""
    client, _ = server
    for body, start in (({"top_p": 0.0}, "top_p 0.0: must be in (0, 1]"),
                        ({"temperature": -1.0}, "temperature -1.0: must be >= 0"),
                        ({"top_k": -2}, "top_k -2: must be >= 0"),
                        ({"prompt": list(range(5, 35)), "max_tokens": 6},
                         "the prompt has 30 tokens and max_tokens is 6: 36 tokens exceed the "
                         "model's context of 32")):
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"].startswith(start), r.text


def test_startup_log_holds_no_megatron_noise(server):
    """The server's log is its own: megatron-core's Megatron-FSDP INFO lines (three at import)
    are filtered as the other entry points filter megatron-core's noise."""
    _, log_path = server
    text = open(log_path).read()
    assert "megaloop.serve: serving" in text, text
    noise = [line for line in text.splitlines() if "megatron" in line or "Warning" in line]
    assert noise == [], noise
