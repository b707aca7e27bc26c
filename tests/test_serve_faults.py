"""tools/serve.py under bad requests (a real server subprocess on 127.0.0.1, as in
tests/test_serve.py): a seed torch's generator cannot take, a temperature whose logits / temperature
overflow, ``Infinity`` and ``NaN`` in the JSON, a lone surrogate in a prompt and a body of 50 MB
each get a 4xx naming the field or flag, while good streams decoded alongside them complete with
the text each gets alone; a large prompt is tokenized off the event loop (``/health`` answers
meanwhile). Faults past these checks (a row the engine refuses, a draw that fails) end only
their own request: tests/test_serve_tp.py and tests/test_engine.py."""

import concurrent.futures
import json
import select
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import ckpt, serving  # noqa: E402,F401 (ckpt: the module's checkpoint fixture)

LIMIT = 4 * 1024 * 1024  # --max-request-bytes' default


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):  # noqa: F811
    with serving(ckpt, [], str(tmp_path_factory.mktemp("faults") / "server.log")) as s:
        yield s


def _stream(base_url: str, body: dict, first: threading.Event = None) -> dict:
    """{choice index: (concatenated text, finish_reason)} of a streamed completion; an error
    event or a missing [DONE] fails. ``first`` is set at the first chunk."""
    out, done = {}, False
    with httpx.Client(base_url=base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line:
                    continue
                if first is not None:
                    first.set()
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text, finish = out.get(c["index"], ("", None))
                    out[c["index"]] = (text + c["text"], c["finish_reason"] or finish)
    assert done, out
    return out


def _message(status: int, body: str) -> str:
    """The error message of a response body (the body itself when it holds none)."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:300]}"


def _raw(port: int, head: bytes, chunks) -> tuple[int, str]:
    """(status, JSON body) of a request written by hand: ``head`` then ``chunks`` of body, as
    long as the server has not answered (it may answer, and close, before reading them all)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        for chunk in chunks:
            if select.select([s], [], [], 0)[0]:
                break  # the answer is there: read it before the server closes
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        data, deadline = b"", time.monotonic() + 30
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                _header(data, b"content-length") or 0) or not _header(data, b"content-length"):
            assert time.monotonic() < deadline, data
            part = s.recv(65536)
            if not part:
                break
            data += part
    head_text, body = data.split(b"\r\n\r\n", 1)
    return int(head_text.split()[1]), body.decode(errors="replace")


def _header(data: bytes, name: bytes):
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _post_head(port: int, length: int = None, path: str = "/v1/completions") -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            f"\r\n{size}\r\n\r\n").encode()


GOOD = [dict(prompt=[5, 6, 7, 8], max_tokens=26, temperature=0, ignore_eos=True),
        dict(prompt="9 10 11", max_tokens=26, temperature=0.9, seed=3, n=8, ignore_eos=True),
        dict(prompt=[[12, 13], [14, 15, 16]], max_tokens=24, temperature=1.0, seed=7, n=6,
             ignore_eos=True)]


def _bad_requests(client, port: int) -> list:
    """(what, status, error message) of one request of each bad kind."""
    out = []

    def send(what, path, body=None, raw=None):
        if raw is not None:
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
        out.append((what, r.status_code, _message(r.status_code, r.text)))

    chat = {"messages": [{"role": "user", "content": "5 6"}], "max_tokens": 4}
    send("seed 2**64", "/v1/completions", {"prompt": [5, 6], "seed": 2 ** 64})
    send("seed -2**64", "/v1/completions", {"prompt": [5, 6], "seed": -2 ** 64})
    send("chat seed 2**64", "/v1/chat/completions", {**chat, "seed": 2 ** 64})
    send("chat seed -2**64", "/v1/chat/completions", {**chat, "seed": -2 ** 64})
    send("temperature 1e-45", "/v1/completions", {"prompt": [5, 6], "temperature": 1e-45})
    send("temperature Infinity", "/v1/completions",
         raw=b'{"prompt": [5, 6], "temperature": Infinity}')
    send("top_p NaN", "/v1/completions", raw=b'{"prompt": [5, 6], "top_p": NaN}')
    send("lone surrogate", "/v1/completions", raw=b'{"prompt": "5 \\ud800 6", "max_tokens": 2}')
    # 50 MB announced: refused before the body is read (only 64 KB of it is ever sent here).
    status, body = _raw(port, _post_head(port, 50_000_000), [b" " * 65536])
    out.append(("50 MB body", status, _message(status, body)))
    # No length (chunked): refused once the bytes received pass the limit.
    piece = b" " * 65536
    chunked = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(LIMIT // len(piece) + 16))
    status, body = _raw(port, _post_head(port) + b'1\r\n{\r\n', chunked)
    out.append(("chunked body over the limit", status, _message(status, body)))
    return out


EXPECTED = {"seed 2**64": (400, "seed 18446744073709551616: must be an integer from "
                                "-9223372036854775808 to 18446744073709551615"),
            "seed -2**64": (400, "seed -18446744073709551616: must be an integer"),
            "chat seed 2**64": (400, "seed 18446744073709551616: must be an integer"),
            "chat seed -2**64": (400, "seed -18446744073709551616: must be an integer"),
            "temperature 1e-45": (400, "temperature 1e-45: too small to sample with"),
            "temperature Infinity": (400, "temperature inf: must be a finite number"),
            "top_p NaN": (400, "top_p nan: must be a finite number"),
            "lone surrogate": (400, "prompt holds a lone surrogate (U+D800 at character 2)"),
            "50 MB body": (413, "the request body has 50000000 bytes; this server takes at "
                                f"most {LIMIT} (--max-request-bytes)"),
            "chunked body over the limit": (413, f"the request body has more than {LIMIT} "
                                                 f"bytes; this server takes at most {LIMIT} "
                                                 f"(--max-request-bytes)")}


def test_bad_requests_are_refused_and_good_streams_decode_on(server):
    """Good streams (greedy; sampled with a seed and n 8; two prompts with n 6: 21 rows) are
    asked alone first; then again, and once the server is streaming them, one request of each
    bad kind is sent. Each bad one gets its 4xx and message; each good stream completes with
    the text (and finish reason) it got alone; no engine was dropped."""
    client, _ = server
    port, base = client.base_url.port, str(client.base_url)
    alone = [_stream(base, body) for body in GOOD]
    firsts = [threading.Event() for _ in GOOD]
    with concurrent.futures.ThreadPoolExecutor(len(GOOD)) as pool:
        streams = [pool.submit(_stream, base, body, first) for body, first in zip(GOOD, firsts)]
        assert all(first.wait(120) for first in firsts)
        try:
            bad = _bad_requests(client, port)
        finally:  # a stream that failed is the first thing to report
            together = [s.result(timeout=120) for s in streams]
    assert together == alone
    for what, status, message in bad:
        want_status, start = EXPECTED[what]
        assert (status, message[:len(start)]) == (want_status, start), (what, status, message)
    assert len(bad) == len(EXPECTED)
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/stats").json()["engine_restarts"] == 0


def test_a_large_prompt_is_tokenized_off_the_event_loop(server):
    """A text prompt of 3.9 MB (under the body limit: 1.9M tokens of the null tokenizer) takes
    the server a while to tokenize before its 400 (over --max-request-tokens); /health, asked
    over and over meanwhile, never waits for it: the longest /health wait is a small part of
    the large request's time. When the event loop tokenized, one /health waited about as long
    as the tokenizer ran (most of the request's time)."""
    client, _ = server
    body = {"prompt": "5 " * 1_900_000 + "5", "max_tokens": 2}
    waits, big = [], {}

    def send_big():
        with httpx.Client(base_url=str(client.base_url), timeout=120) as c:
            start = time.monotonic()
            r = c.post("/v1/completions", json=body)
            big["took"] = time.monotonic() - start
            big["status"], big["message"] = r.status_code, r.json()["error"]["message"]

    thread = threading.Thread(target=send_big)
    thread.start()
    deadline = time.monotonic() + 120
    while thread.is_alive():  # (the last wait may end after the large request: it counts)
        assert time.monotonic() < deadline
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        waits.append(time.monotonic() - start)
    thread.join()
    assert big["status"] == 400 and "(--max-request-tokens)" in big["message"], big
    print(f"/health answered {len(waits)} times in the large request's {big['took']:.2f} s; "
          f"the longest wait {max(waits):.3f} s")
    assert max(waits) < big["took"] / 4, (max(waits), big["took"])
