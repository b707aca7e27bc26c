"""tools/serve.py with a text tokenizer (a tiny model with a sentencepiece tokenizer, its own
server): chat completions with the default template (megaloop's SFT layout, built here by hand),
the ``openai`` Python client (chat, streaming, completions, models, refusals), one special-token
rule for /tokenize, completions and chat, and clients that leave mid-answer (their job stops, the
next request is answered). A tokenizer's own chat template renders as ``transformers``' does."""

import json
import os
import random
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from distributed import run_distributed  # noqa: E402
from flags import TEST_FLAGS  # noqa: E402
from test_serve import ROOT, serving  # noqa: E402

CONTEXT = 128


def _train(rank, world, argv):
    import run_helpers

    return run_helpers.train(argv)[0]  # the exit code


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(httpx client, server log, sentencepiece tokenizer) of a served tiny sentencepiece model."""
    import importlib.util

    from megaloop.data.tokenizers import SentencePieceTokenizer, train_sentencepiece

    tmp = tmp_path_factory.mktemp("serve_chat")
    spec = importlib.util.spec_from_file_location(
        "make_demo_corpus", os.path.join(ROOT, "megaloop", "cli", "make_demo_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    rng = random.Random(0)
    sp = train_sentencepiece([corpus.document(rng, 6) for _ in range(300)], str(tmp / "sp"),
                             vocab_size=512)
    ckpt = str(tmp / "ckpt")
    assert run_distributed(_train, 1, [
        *TEST_FLAGS, "--num-layers", "2", "--num-loops", "3", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", str(CONTEXT), "--max-position-embeddings",
        str(CONTEXT), "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
        "2", "--lr", "1e-2", "--mock-data", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", sp, "--eval-iters", "0", "--log-interval", "1", "--save", ckpt]) == [0]
    with serving(ckpt, ["--model-name", "tiny"], str(tmp / "server.log")) as (client, log):
        yield client, log, SentencePieceTokenizer(sp)


def _post(client, path, **body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _openai(client):
    return openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="none",
                         max_retries=0)


MESSAGES = [{"role": "system", "content": "the river is quiet ."},
            {"role": "user", "content": " x = 3 ; y = x + 4 ; y ?"},
            {"role": "assistant", "content": " 7"},
            {"role": "user", "content": " and the garden ?"}]


def test_chat_default_template_is_the_sft_layout(served):
    """A sentencepiece model has no template of its own: the prompt is megaloop's instruction
    layout (megaloop/data/sft_examples.py), built here token by token; its greedy answer is the
    completion of those ids."""
    client, _, sp = served
    want = []
    for m in MESSAGES:
        want += sp.tokenize(m["role"] + ":") + sp.tokenize(m["content"])
        want += [sp.eod] if m["role"] == "assistant" else []
    want += sp.tokenize("assistant:")
    chat = _post(client, "/v1/chat/completions", model="tiny", messages=MESSAGES,
                 max_tokens=10, temperature=0)
    assert chat["object"] == "chat.completion" and chat["model"] == "tiny"
    assert chat["usage"]["prompt_tokens"] == len(want)
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant"
    plain = _post(client, "/v1/completions", prompt=want, max_tokens=10, temperature=0)
    assert choice["message"]["content"] == plain["choices"][0]["text"]
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chat["usage"] == plain["usage"]
    # log-probs: the completions endpoint's numbers (checked against a full forward in
    # tests/test_serve.py) in the chat format
    lp = _post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=10, temperature=0,
               logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    ref = _post(client, "/v1/completions", prompt=want, max_tokens=10, temperature=0,
                logprobs=2)["choices"][0]["logprobs"]
    assert [e["token"] for e in lp] == ref["tokens"]
    assert [e["logprob"] for e in lp] == pytest.approx(ref["token_logprobs"], abs=1e-6)
    for e, top in zip(lp, ref["top_logprobs"]):
        assert [(t["token"], pytest.approx(t["logprob"], abs=1e-6)) for t in e["top_logprobs"]] \
            == list(top.items())[:2]
        assert e["bytes"] == list(e["token"].encode())
    for bad in ({"logprobs": True, "stream": True}, {"top_logprobs": 2}):
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **bad})
        assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text


def test_openai_client(served):
    client, _, _ = served
    api = _openai(client)
    assert api.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("another")
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = api.chat.completions.create(**kw)
    deltas, finish, used, roles = [], [], None, []
    for chunk in api.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.usage is not None:
            used = chunk.usage
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            roles.append(c.delta.role)
            finish.append(c.finish_reason)
    assert "".join(deltas) == whole.choices[0].message.content
    assert roles[0] == "assistant" and finish[-1] == whole.choices[0].finish_reason
    assert finish[:-1] == [None] * (len(finish) - 1)
    assert used.model_dump() == whole.usage.model_dump()
    # n choices with a seed, reproducible through the client too
    sampled = [[c.message.content for c in api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, n=3, seed=5).choices]
        for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 3
    # completions: the same answer as a plain HTTP request
    done = api.completions.create(model="tiny", prompt="the river is", max_tokens=8,
                                  temperature=0)
    raw = _post(client, "/v1/completions", prompt="the river is", max_tokens=8, temperature=0)
    assert done.choices[0].text == raw["choices"][0]["text"]
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        api.chat.completions.create(**kw, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="tools"):
        api.chat.completions.create(**kw, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])


def test_special_tokens_read_the_same_in_tokenize_completions_and_chat(served):
    """The end-of-document piece (sentencepiece's "</s>", which it would spell out as several
    pieces) is that one token wherever a request's text holds it."""
    client, _, sp = served
    piece = sp.piece(sp.eod)
    assert piece == "</s>" and len(sp.tokenize(piece)) > 1
    text = f"the river{piece} is quiet"
    want = sp.tokenize("the river") + [sp.eod] + sp.tokenize(" is quiet")
    assert _post(client, "/tokenize", prompt=text)["tokens"] == want
    assert _post(client, "/tokenize", prompt=text, add_special_tokens=True)["tokens"] == \
        [sp.bos] + want
    echoed = _post(client, "/v1/completions", prompt=text, max_tokens=0, echo=True,
                   logprobs=0)
    assert echoed["usage"]["prompt_tokens"] == len(want)
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == len(want)
    chat = _post(client, "/v1/chat/completions", messages=[{"role": "user", "content": text}],
                 max_tokens=1)
    assert chat["usage"]["prompt_tokens"] == len(
        sp.tokenize("user:") + want + sp.tokenize("assistant:"))


def _cancelled_lines(log: str) -> list:
    return [line for line in open(log).read().splitlines() if "job cancelled" in line]


def _wait_cancelled(log: str, count: int) -> str:
    deadline = time.monotonic() + 120  # (a loaded machine: a step of 64 new rows takes seconds)
    while len(_cancelled_lines(log)) < count:
        assert time.monotonic() < deadline, open(log).read()[-3000:]
        time.sleep(0.1)
    return _cancelled_lines(log)[count - 1]


def test_a_client_that_leaves_has_its_job_cancelled(served):
    """A streaming client that closes the connection after its first chunk, and a client that
    gives up waiting for a long answer: each job stops early (the model thread logs how many of
    its tokens it made), and the next request is answered."""
    client, log, _ = served
    before = len(_cancelled_lines(log))
    # 8 prompts x n 8 = 64 rows x 124 tokens: seconds of work on the tiny model
    big = dict(prompt=[[5 + i, 6, 7, 8] for i in range(8)], n=8, max_tokens=CONTEXT - 4,
               temperature=1.0, seed=1)
    total = 64 * (CONTEXT - 4)
    with httpx.Client(base_url=str(client.base_url), timeout=60) as leaving:
        with leaving.stream("POST", "/v1/completions", json={**big, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line)
            assert json.loads(first[len("data: "):])["choices"][0]["index"] >= 0
    made = int(_wait_cancelled(log, before + 1).split(" after ")[1].split()[0])
    assert made < total
    start = time.monotonic()
    small = _post(client, "/v1/completions", prompt="the river", max_tokens=4, temperature=0)
    print(f"answered {time.monotonic() - start:.2f} s after the stream's job was cancelled")
    assert small["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=str(client.base_url), timeout=0.3) as impatient:
            impatient.post("/v1/completions", json=big)
    made = int(_wait_cancelled(log, before + 2).split(" after ")[1].split()[0])
    assert made < total
    assert _post(client, "/v1/completions", prompt="the river", max_tokens=4,
                 temperature=0)["choices"] == small["choices"]


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_tokenizer_chat_template_renders_as_transformers_does(tmp_path):
    """A Hugging Face tokenizer folder with a chat_template in tokenizer_config.json: the prompt
    ids equal transformers' apply_chat_template(add_generation_prompt=True)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megaloop.data.tokenizers import HuggingFaceTokenizer
    from megaloop.inference.chat import ChatTemplate

    words = sorted({w for m in MESSAGES for w in m["content"].split()} |
                   {"system", "user", "assistant", "<unk>"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": CHATML}, f)
    ours = HuggingFaceTokenizer(str(tmp_path))
    template = ChatTemplate(ours, ours.tokenize)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                  eos_token="<|endoftext|>")
    want = theirs.apply_chat_template(MESSAGES, chat_template=CHATML, tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
    assert template.kind == "tokenizer"
    assert template.render(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    assert template.ids(MESSAGES) == list(want)
    assert template.ids(MESSAGES).count(ours._tok.token_to_id("<|im_start|>")) == 5
