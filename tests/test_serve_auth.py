"""tools/serve.py's access and address flags: ``--api-key`` against a real server subprocess on
127.0.0.1 (a request without the key, or with another, gets HTTP 401 with an OpenAI-style error
body; with it, the answer; ``/health`` stays open), the one-line warning when serving beyond
loopback without a key, and ``--port`` outside 1..65535 refused in one line before any model
loads."""

import os
import signal

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import _serve_tool, ckpt, serving  # noqa: E402,F401 (ckpt: the module's fixture)

KEY = "sk-test-7f3a"


@pytest.fixture(scope="module")
def keyed(ckpt, tmp_path_factory):  # noqa: F811
    with serving(ckpt, ["--api-key", KEY, "--served-model-name", "tiny"],
                 str(tmp_path_factory.mktemp("serve_auth") / "server.log")) as s:
        yield s


def _assert_refused(r, words: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert words in error["message"] and KEY not in error["message"], error


def test_requests_need_the_key_health_does_not(keyed):
    client, log_path = keyed
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    _assert_refused(client.post("/v1/completions", json=body), "no API key")
    for header in (f"Bearer {KEY}x", f"Basic {KEY}", "Bearer", f"{KEY}"):
        _assert_refused(client.post("/v1/completions", json=body,
                                    headers={"Authorization": header}), "incorrect API key")
    for path in ("/v1/models", "/stats", "/tokenizer_info"):
        _assert_refused(client.get(path), "no API key")
    _assert_refused(client.post("/tokenize", json={"prompt": "5 6"}), "no API key")
    assert client.get("/health").status_code == 200

    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert client.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
    assert client.post("/tokenize", json={"prompt": "5 6"}, headers=auth).json()["tokens"] == [5, 6]
    log = open(log_path).read()
    assert "POST /v1/completions 401" in log and "POST /v1/completions 200" in log, log
    assert "warning:" not in log  # 127.0.0.1 is loopback


class _Stop(Exception):
    """Raised where the model would start loading: what main printed before it is complete."""


def _start(ckpt, flags, monkeypatch, capsys):  # noqa: F811
    """tools/serve.py's main up to its first step of loading the model: (exit code or None when
    it got there, stderr)."""
    import megaloop.inference.loading as loading

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(loading, "setup_processes", stop)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # (pytest's handlers stay)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        code = _serve_tool().main(["--load", ckpt, *flags])
    except _Stop:
        code = None
    return code, capsys.readouterr().err


def test_serving_beyond_loopback_without_a_key_warns_once(ckpt, monkeypatch, capsys):  # noqa: F811
    monkeypatch.delenv("MEGALOOP_API_KEY", raising=False)
    code, err = _start(ckpt, ["--host", "0.0.0.0", "--port", "8123"], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line]
    assert code is None and len(lines) == 1, err
    assert lines[0].startswith("warning: --host 0.0.0.0 serves beyond this machine without "
                               "--api-key: anyone who reaches port 8123"), err
    for flags in (["--host", "127.0.0.1"], ["--host", "127.0.0.2"], ["--host", "::1"],
                  ["--host", "localhost"], ["--host", "0.0.0.0", "--api-key", KEY]):
        code, err = _start(ckpt, flags, monkeypatch, capsys)
        assert code is None and "warning" not in err, (flags, err)
    # The key from the environment is a key: no warning either.
    monkeypatch.setenv("MEGALOOP_API_KEY", KEY)
    code, err = _start(ckpt, ["--host", "0.0.0.0"], monkeypatch, capsys)
    assert code is None and "warning" not in err, err


@pytest.mark.parametrize("flags, words", [
    (["--port", "70000"], "--port 70000: must be from 1 to 65535"),
    (["--port", "-5"], "--port -5: must be from 1 to 65535"),
    (["--port", "0"], "--port 0: must be from 1 to 65535"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_bad_address_and_key_flags_are_one_line_before_loading(
        ckpt, flags, words, monkeypatch, capsys):  # noqa: F811
    monkeypatch.delenv("MEGALOOP_API_KEY", raising=False)
    code, err = _start(ckpt, flags, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {words}"), err
    assert not torch.distributed.is_initialized()
