"""tools/serve.py end to end: a tiny trained checkpoint served by a real server subprocess on
127.0.0.1, asked with a real HTTP client. Greedy answers equal tools/generate.py's; concurrent
requests equal the sequential ones; echo + logprobs equal an independent log-softmax of the full
forward; malformed requests get a 4xx with a message and the server keeps serving; streamed
chunks (raw server-sent events) concatenate to the answer; stop strings stop generation; ``n``;
unknown fields and the per-request limits are refused by name. Chat, the ``openai`` client,
special tokens and disconnecting clients: tests/test_serve_chat.py."""

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import signal
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
LIMITS = ["--max-prompts-per-request", "3", "--max-n", "3", "--max-request-tokens", "60"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("serve") / "ckpt")
    run_distributed(_train_and_save, 1, path)
    return path


@contextlib.contextmanager
def serving(load: str, extra: list, log_path: str, launcher: tuple = (), procs: list = None):
    """(client, log path) of a tools/serve.py subprocess on a free port (``launcher``: e.g.
    torchrun's command), killed at the end; the process is appended to ``procs``."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*(launcher or [sys.executable]), os.path.join(ROOT, "tools", "serve.py"), "--load",
             load, "--host", "127.0.0.1", "--port", str(port), *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, MEGALOOP_SHIM_CHECK_PLACEMENT="1",  # CPU: placement-checked
                     **({"OMP_NUM_THREADS": "1"} if launcher else {})))
    if procs is not None:
        procs.append(proc)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        ready_s = 300 if launcher else 180  # (a loaded machine; torchrun starts slower)
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{open(log_path).read()}")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready in {ready_s} s:\n{open(log_path).read()}")
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


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with serving(ckpt, [*LIMITS, "--served-model-name", "tiny"],
                 str(tmp_path_factory.mktemp("serve_log") / "server.log")) as s:
        yield s


def _complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split()]  # the null tokenizer's text


def test_models(server):
    client, _ = server
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]


def test_the_default_model_id_skips_a_generic_folder_name(ckpt, tmp_path):
    """Without --served-model-name a checkpoint at demo/checkpoint serves as "demo" (the folder
    name "checkpoint" says nothing of the model), in /v1/models and in the start line."""
    demo = tmp_path / "demo"
    demo.mkdir()
    os.symlink(ckpt, demo / "checkpoint")  # the path's names are read, not the link's target
    with serving(str(demo / "checkpoint"), [], str(tmp_path / "server.log")) as (client, log):
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["demo"]
        assert "serving model id 'demo'" in open(log).read()


def test_default_model_id_and_the_name_flags():
    """The default id climbs over generic folder names only; --model-name is an alias of
    vLLM's --served-model-name (one argument, one destination)."""
    tool = _serve_tool()
    assert tool.default_model_id("runs/demo/checkpoint") == "demo"
    assert tool.default_model_id("runs/demo/checkpoints/") == "demo"
    assert tool.default_model_id("runs/big/ckpt/iter_0000100") == "big"
    assert tool.default_model_id("runs/mymodel") == "mymodel"
    assert tool.default_model_id("runs/iter_0000100_notes") == "iter_0000100_notes"
    parser = tool.build_parser()
    for flag in ("--served-model-name", "--model-name"):
        assert parser.parse_args(["--load", "x", flag, "named"]).model_name == "named"
    (action,) = [a for a in parser._actions if "--served-model-name" in a.option_strings]
    assert action.option_strings == ["--served-model-name", "--model-name"]
    assert "vLLM" in action.help


def test_greedy_ids_equal_generate_tool(server, ckpt, tmp_path):
    """Token-id prompts (one, and a batch of two of different lengths), greedy: the ids that
    tools/generate.py prints for the same prompts."""
    client, _ = server
    code, printed = run_distributed(
        _generate_tool, 1, ["--load", ckpt, "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
                            "--max-tokens", "12"], str(tmp_path / "gen"))[0]
    assert code == 0
    want = [[int(i) for i in line.split(",")] for line in printed.strip().split("\n")]
    one = _complete(client, model="tiny", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    batch = _complete(client, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=12, temperature=0)
    assert one["object"] == "text_completion" and one["model"] == "tiny"
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


def _assert_same_choices(got: list, want: list) -> None:
    """The same texts, finish reasons and tokens; log-probs to 1e-5 (a batched forward sums in
    another order than a forward of one row: the last bits differ)."""
    def numbers(choices):
        out = []
        for c in choices:
            lp = c["logprobs"]
            out.append(None if lp is None else (lp["token_logprobs"], [
                sorted(t.items()) if t else t for t in lp["top_logprobs"]]))
        return out

    def rest(choices):
        return [{**c, "logprobs": c["logprobs"] and {"tokens": c["logprobs"]["tokens"],
                                                     "text_offset": c["logprobs"]["text_offset"]}}
                for c in choices]

    assert [rest(c) for c in got] == [rest(c) for c in want]
    for g, w in zip(got, want):
        for a, b in zip(numbers(g), numbers(w)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == pytest.approx(b[0], abs=1e-5)
                for ta, tb in zip(a[1], b[1]):
                    if ta is not None:
                        assert [k for k, _ in ta] == [k for k, _ in tb]
                        assert [v for _, v in ta] == pytest.approx([v for _, v in tb], abs=1e-5)


def test_concurrent_requests_equal_sequential(server):
    client, log_path = server
    bodies = [dict(prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=2),
              dict(prompt="9 10 11", max_tokens=6, temperature=0.9, top_k=20, seed=3),
              dict(prompt=[[12, 13], [14, 15, 16]], max_tokens=5, temperature=0),
              dict(prompt=[17, 18, 19, 20, 21], max_tokens=0, echo=True, logprobs=1)]
    sequential = [_complete(client, **b)["choices"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        concurrent_ = list(pool.map(lambda b: _complete(client, **b)["choices"], bodies * 2))
    _assert_same_choices(concurrent_, sequential * 2)
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


def _serve_tool():
    """tools/serve.py as a module (its main() callable in this process)."""
    spec = importlib.util.spec_from_file_location("serve_tool",
                                                  os.path.join(ROOT, "megaloop", "cli", "serve.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_serve_refuses_a_tensor_parallel_size_other_than_the_launch(monkeypatch, capsys):
    """Every rank of the server is tensor parallel: a size that is not the launch's is refused
    (exit 2) before any process group starts."""
    tool = _serve_tool()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert tool.main(["--load", "nowhere", "--port", "1", "--tensor-model-parallel-size",
                      "4"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size 4: this launch has 2 ranks" in err, err
    assert not torch.distributed.is_initialized()


def test_serve_refuses_what_speculation_cannot_run_with(ckpt, monkeypatch, capsys):
    """--speculate with an exit rule or a one-slot KV policy, or not d:k: exit 2, the flag
    named, before any process group starts."""
    tool = _serve_tool()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    for extra, words in ((["--exit", "q:0.5"], "--speculate 2:2 and --exit: choose one"),
                         (["--kv-policy", "last-step"], "--speculate 2:2 needs --kv-policy full")):
        assert tool.main(["--load", ckpt, "--port", "1", "--speculate", "2:2"] + extra) == 2
        err = capsys.readouterr().err
        assert words in err, err
    assert tool.main(["--load", ckpt, "--port", "1", "--speculate", "two"]) == 2
    assert "--speculate 'two': give d:k" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_tp2_server_under_torchrun_answers_as_tp1(server, ckpt, tmp_path):
    """``torchrun --nproc-per-node 2 tools/serve.py --tensor-model-parallel-size 2``: rank 0
    answers HTTP (greedy ids of two prompts, a sampled request with a seed and n, a stop string,
    a stream) exactly as the TP=1 server does; SIGTERM stops every rank (nothing hangs)."""
    client, _ = server
    bodies = [dict(prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=10, temperature=0),
              dict(prompt=[11, 12, 13], max_tokens=8, temperature=0.9, seed=4, n=2),
              dict(prompt=[5, 6, 7, 8], max_tokens=10, temperature=0, logprobs=2)]
    want = [_complete(client, **b) for b in bodies]
    # A stop string every rank's row hook must see (rank 1 ends the row where rank 0 does).
    bodies.append(dict(prompt=[5, 6, 7, 8], max_tokens=10, temperature=0,
                       stop=want[0]["choices"][0]["text"].split()[2]))
    want.append(_complete(client, **bodies[-1]))
    assert want[-1]["choices"][0]["finish_reason"] == "stop"
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()))
    procs, log = [], str(tmp_path / "tp2.log")
    with serving(ckpt, ["--tensor-model-parallel-size", "2"], log, launcher, procs) as (tp2, _):
        got = [_complete(tp2, **b) for b in bodies]
        streamed = _events(tp2, bodies[0])
        for w, g in zip(want, got):
            assert [c["text"] for c in g["choices"]] == [c["text"] for c in w["choices"]]
            assert g["usage"] == w["usage"]
        assert got[2]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want[2]["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
        for i, choice in enumerate(want[0]["choices"]):
            assert "".join(c["choices"][0]["text"] for c in streamed
                           if c["choices"][0]["index"] == i) == choice["text"]
        assert tp2.get("/stats").json()["decode_rows_max"] >= 2
        procs[0].send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        procs[0].wait(timeout=90)
    text = open(log).read()
    assert "Finished server process" in text, text[-3000:]  # rank 0 left its loop and stopped
    assert text.count("megaloop.serve: serving") == 1  # rank 0 only


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


def test_the_suggested_max_tokens_counts_the_prompt(server, ckpt):
    """A request past the model's context gets the bound that the prompt leaves: that value
    is answered, one more is refused (the numbers from the checkpoint's context and the prompt's
    length; tools/generate.py's side: tests/test_generate_bounds.py)."""
    from megaloop.checkpoint.config import read_run_config
    from megaloop.inference.loading import context_length

    client, _ = server
    context = context_length(read_run_config(ckpt))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    bound = context - len(prompt)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": context + 8})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"lower max_tokens {context + 8} to at most {bound} " in message, message
    body = {"prompt": prompt, "max_tokens": bound, "temperature": 0, "ignore_eos": True}
    answer = _complete(client, **body)
    assert answer["usage"]["completion_tokens"] == bound
    r = client.post("/v1/completions", json={**body, "max_tokens": bound + 1})
    assert r.status_code == 400 and f"at most {bound} " in r.json()["error"]["message"], r.text


def test_startup_log_holds_no_megatron_noise(server):
    """The server's log is its own: megatron-core's Megatron-FSDP INFO lines (three at import)
    are filtered as the other entry points filter megatron-core's noise."""
    _, log_path = server
    text = open(log_path).read()
    assert "megaloop.serve: serving" in text, text
    noise = [line for line in text.splitlines() if "megatron" in line or "Warning" in line]
    assert noise == [], noise


def _events(client, body) -> list:
    """The parsed ``data:`` payloads of a streamed request, ``[DONE]`` last (raw SSE lines)."""
    out = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                out.append(line[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return [json.loads(x) for x in out[:-1]]


def test_health_and_model_by_id(server):
    client, _ = server
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    r = client.get("/v1/models/another")
    assert r.status_code == 404 and "another" in r.json()["error"]["message"]


def test_streamed_chunks_concatenate_to_the_answer(server):
    """Two prompts, greedy, with a stop string: every choice's chunks concatenate to its
    non-streamed text, its last chunk carries the same finish_reason, the usage chunk equals the
    answer's usage; without stop strings a token is one chunk (the null tokenizer: one id)."""
    client, _ = server
    plain = _complete(client, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0)["choices"][0]
    stop = plain["text"].split()[3]  # the 4th token's text: stops the first prompt there
    body = dict(prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=8, temperature=0, stop=[stop])
    want = _complete(client, **body)
    chunks = _events(client, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == want["usage"]
    for i, choice in enumerate(want["choices"]):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + \
            [choice["finish_reason"]]
    assert want["choices"][0]["finish_reason"] == "stop"
    # Without a stop string nothing is held back: a chunk per token, as it is generated.
    chunks = _events(client, dict(prompt=[5, 6, 7, 8], max_tokens=8, temperature=0))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == plain["text"] and len(texts) == len(_ids(plain["text"])) + 1
    assert all(len(_ids(t)) == 1 for t in texts[:-1]) and texts[-1] == ""  # then the finish


def test_stop_strings_stop_generation_and_usage_counts_what_was_generated(server):
    """The row ends at the first token whose text completes a stop string (derived here from
    the unstopped greedy ids): completion_tokens counts exactly the tokens up to that one."""
    client, _ = server
    full = _ids(_complete(client, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                          )["choices"][0]["text"])
    stop = f"{full[1]} {full[2]}"  # the text of the 2nd and 3rd generated tokens
    text = lambda k: " " + " ".join(map(str, full[:k]))  # noqa: E731 (the null tokenizer's)
    k = next(k for k in range(1, len(full) + 1) if stop in text(k))
    got = _complete(client, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, stop=stop)
    assert got["choices"][0]["text"] == text(k)[:text(k).find(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"] == {"prompt_tokens": 4, "completion_tokens": k, "total_tokens": 4 + k}


def test_n_choices_reproducible_with_a_seed(server):
    client, _ = server
    body = dict(prompt=[[5, 6], [7, 8]], max_tokens=6, temperature=1.0, n=3, seed=11)
    one, again = _complete(client, **body), _complete(client, **body)
    assert one["choices"] == again["choices"]
    assert [c["index"] for c in one["choices"]] == list(range(6))
    other = _complete(client, **{**body, "seed": 12})
    assert other["choices"] != one["choices"]
    # prompts counted once, every generated token (its EOD too) once
    generated = sum(len(_ids(c["text"])) + (c["finish_reason"] == "stop")
                    for c in one["choices"])
    assert one["usage"] == {"prompt_tokens": 4, "completion_tokens": generated,
                            "total_tokens": 4 + generated}
    # greedy: the n copies of a prompt's answer are that prompt's answer alone
    greedy = _complete(client, prompt=[[5, 6], [7, 8]], max_tokens=6, temperature=0, n=2)
    alone = [_complete(client, prompt=p, max_tokens=6, temperature=0)["choices"][0]["text"]
             for p in ([5, 6], [7, 8])]
    assert [c["text"] for c in greedy["choices"]] == [alone[0]] * 2 + [alone[1]] * 2


def test_a_seed_samples_as_generate_tool_samples_with_it(server, ckpt, tmp_path):
    """One seed range for the server's requests and tools/generate.py's --seed (64 bits, signed
    or unsigned; flags.check_seed): a seed beyond numpy's 0 .. 2**32 - 1 samples the same tokens
    in both, -1 samples as 2**64 - 1, and 2**64 is refused by both, naming the range."""
    client, _ = server
    body = dict(prompt=[5, 6, 7], max_tokens=8, temperature=1.0, ignore_eos=True)
    argv = ["--load", ckpt, "--prompt-ids", "5,6,7", "--max-tokens", "8", "--temperature", "1",
            "--no-stop-at-eod"]
    for seed in (-1, 2 ** 32 + 5):
        code, printed = run_distributed(_generate_tool, 1, argv + ["--seed", str(seed)],
                                        str(tmp_path / "gen"))[0]
        assert code == 0
        served = _complete(client, **body, seed=seed)["choices"][0]["text"]
        assert _ids(served) == [int(i) for i in printed.split(",")], seed
    assert _complete(client, **body, seed=-1)["choices"] == \
        _complete(client, **body, seed=2 ** 64 - 1)["choices"]
    r = client.post("/v1/completions", json={**body, "seed": 2 ** 64})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"seed {2 ** 64}: must be an integer from {-2 ** 63} to {2 ** 64 - 1}"), r.text


def test_unknown_and_unsupported_fields_are_refused_by_name(server):
    client, _ = server
    for extra, name in (({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"frequency_penalty": 0.3}, "frequency_penalty"),
                        ({"suffix": "x"}, "suffix"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                        ({"best_of": 2}, "best_of"), ({"temprature": 0}, "temprature"),
                        ({"tools": [{"type": "function"}]}, "tools")):
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert name in r.json()["error"]["message"], r.text
    # what clients send with their defaults is accepted
    _complete(client, prompt=[5, 6], max_tokens=2, presence_penalty=0, frequency_penalty=0.0,
              logit_bias={}, best_of=1, suffix=None, user="someone")
    # vLLM's ignore_eos is implemented (tests/test_serve_tp.py): every row runs to max_tokens
    assert _complete(client, prompt=[[5, 6], [7]], max_tokens=9, temperature=0,
                     ignore_eos=True)["usage"]["completion_tokens"] == 18
    r = client.post("/v1/completions", json={"prompt": [5, 6], "ignore_eos": "yes"})
    assert r.status_code == 400 and "ignore_eos" in r.json()["error"]["message"], r.text


def test_limits_per_request_name_their_flag(server):
    """The fixture's server runs with LIMITS: 3 prompts, n 3, 60 tokens per request."""
    client, _ = server
    for body, flag in (({"prompt": [[5, 6]] * 4, "max_tokens": 2}, "--max-prompts-per-request"),
                       ({"prompt": [5, 6], "n": 4}, "--max-n"),
                       # 3 prompts x n 3 x (2 + 6) = 72 tokens
                       ({"prompt": [[5, 6]] * 3, "n": 3, "max_tokens": 6}, "--max-request-tokens"),
                       ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and flag in r.json()["error"]["message"], (body, r.text)
    # at the limit: answered (3 x 3 x (2 + 4) = 54)
    assert len(_complete(client, prompt=[[5, 6]] * 3, n=3, max_tokens=4)["choices"]) == 9


def test_null_tokenizer_text_is_read_as_its_ids(server):
    """EOD's piece in the null tokenizer's text is its id ("200"): read as every id is, in
    /tokenize and in a prompt alike (it was split out of the text, which then failed)."""
    client, _ = server
    assert client.post("/tokenize", json={"prompt": "5 200 6"}).json()["tokens"] == [5, EOD, 6]
    echoed = _complete(client, prompt="5 200 6", max_tokens=0, echo=True)
    assert echoed["usage"]["prompt_tokens"] == 3 and echoed["choices"][0]["text"] == "5 200 6"
