"""tools/convert_checkpoint.py and the files it is pointed at: each mistake is one line naming the
file and exit code 2, and nothing that is already there is overwritten.

- export-hf --output-dir (or its old spelling --out): an existing file, a path under a file, a folder that holds files;
- import-hf --hf-dir: a shard cut short (an interrupted download), a shard the index names that is
  missing;
- import-hf --save: a folder that holds a training run's checkpoints, or whose lock a live run
  holds (megaloop/training/save_lock.py).
"""

import json
import os
import socket

import pytest

from test_convert import _make_hf, _run_tool

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def hf_and_ckpt(tmp_path_factory):
    """A tiny Llama folder and its import (a megaloop checkpoint to export)."""
    root = tmp_path_factory.mktemp("files")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    _make_hf("llama", hf_dir)
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", ckpt, "--no-progress"],
                     str(root / "log")) == 0, open(root / "log").read()
    return hf_dir, ckpt


def _error(log):
    """The tool's output: exactly one line, an error without a traceback."""
    lines = open(log).read().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_export_refuses_a_file_and_a_folder_that_holds_files(hf_and_ckpt, tmp_path):
    _, ckpt = hf_and_ckpt
    log = str(tmp_path / "log")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"keep me")
    assert _run_tool(["export-hf", "--load", ckpt, "--output-dir", str(a_file)], log) == 2
    assert f"--output-dir {a_file} is a file, not a folder" in _error(log)
    assert _run_tool(["export-hf", "--load", ckpt, "--out", str(a_file / "hf")], log) == 2
    assert f"is under the file {a_file}" in _error(log)
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert _run_tool(["export-hf", "--load", ckpt, "--output-dir", str(full)], log) == 2
    assert f"--output-dir {full} is not empty (it holds config.json)" in _error(log)
    assert a_file.read_bytes() == b"keep me" and os.listdir(full) == ["config.json"] and \
        (full / "config.json").read_text() == "{}"
    # An empty folder is written.
    (tmp_path / "empty").mkdir()
    assert _run_tool(["export-hf", "--load", ckpt, "--out", str(tmp_path / "empty")], log) == 0
    assert json.load(open(tmp_path / "empty" / "config.json"))["total_ut_steps"] == 3


def test_import_names_a_truncated_shard(tmp_path):
    hf_dir = str(tmp_path / "hf")
    _make_hf("llama", hf_dir)
    shard = os.path.join(hf_dir, "model.safetensors")
    with open(shard, "r+b") as f:  # an interrupted download: the first half of the file
        f.truncate(os.path.getsize(shard) // 2)
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(tmp_path / "ck"),
                      "--no-progress"], log) == 2
    assert f"{shard} is truncated or corrupt" in _error(log)
    assert not os.path.exists(tmp_path / "ck")  # (the lock's folder is not left behind)


def test_import_names_the_missing_shard_file(tmp_path):
    hf_dir = tmp_path / "hf"
    model = _make_hf("llama", str(tmp_path / "whole"))
    model.save_pretrained(str(hf_dir), max_shard_size="20KB")  # several shards and an index
    index = json.load(open(hf_dir / "model.safetensors.index.json"))["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 2
    os.remove(hf_dir / shards[1])
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "ck"),
                      "--no-progress"], log) == 2
    message = _error(log)
    assert f"shard {shards[1]} named by model.safetensors.index.json is missing" in message, \
        message


def test_import_does_not_write_over_a_training_run(hf_and_ckpt, tmp_path):
    """A folder with a run's checkpoints keeps its `latest` (before: moved from 10 to 0)."""
    hf_dir, _ = hf_and_ckpt
    run = tmp_path / "run"
    os.makedirs(run / "iter_0000010")
    (run / TRACKER).write_text("10")
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(run), "--no-progress"],
                     log) == 2
    message = _error(log)
    assert f"--save {run} already holds a run's checkpoints (iter_0000010, {TRACKER})" in message
    assert (run / TRACKER).read_text() == "10"
    assert sorted(os.listdir(run)) == ["iter_0000010", TRACKER]


def test_import_takes_the_save_lock(hf_and_ckpt, tmp_path):
    """A run that is still going (its lock: this live process on this host) keeps its folder."""
    hf_dir, _ = hf_and_ckpt
    run = tmp_path / "run"
    run.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
              "started": "2026-12-03 09:00:00 UTC", "token": "a-live-run"}
    (run / "megaloop_run.lock").write_text(json.dumps(holder))
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(run), "--no-progress"],
                     log) == 2
    assert f"--save {run} is in use by another run: pid {os.getpid()}" in _error(log)
    assert os.listdir(run) == ["megaloop_run.lock"]
    # Once the run is gone the import goes ahead, and leaves no lock behind.
    os.remove(run / "megaloop_run.lock")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(run), "--no-progress"],
                     log) == 0
    assert sorted(os.listdir(run)) == ["iter_0000000", TRACKER]
