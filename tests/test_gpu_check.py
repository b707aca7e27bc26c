"""tools/gpu_check.sh rehearsed on CPU, its process handling, and the two GPU defects it found.

The GPU rows need a GPU (they have not run where this suite runs). What CPU can check is checked
here: the script runs every command line of the GPU check with the GPU-only flags swapped (the
rehearsal: a schedule or flag mistake such as a resume refused at load fails here first), every
GPU command line passes validation as it would on a GPU, a failing row shows the program's
Python traceback (not torchrun's banner), a timed-out row leaves no process behind, and
--attention-backend / context parallelism / the interpreter choice behave as on a GPU.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from distributed import gpu_count
from megaloop.gpu_check import procs, rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(gpu_count() > 0, reason="on a GPU the script runs the full 10-minute check")
def test_cpu_rehearsal_runs_every_gpu_row(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(["bash", SCRIPT, "--output-dir", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.load(open(out / "summary.json"))
    status = {r["row"]: r["status"] for r in summary["rows"]}
    expected = (["environment"]
                + [f"TE vs local grads {p} T=3: {v}" for p, v, _, _ in rows.grads_runs()]
                + ["smoke: train 5 + eval + save (bf16 TE, T=3)",
                   "smoke: resume 5 -> 7 under torchrun",
                   "smoke: resumed 6-7 equal a straight 7-iteration run"]
                + [f"FP8 {r}: 2 steps vs bf16 (looped 6 x 4)" for r in rows.FP8]
                + [f"throughput {k}" for k in rows.timed_runs(False)])
    for row in expected:
        assert status.get(row) in ("REHEARSED", "INFO"), (row, status.get(row))
    assert status["pytest -m gpu tests"] == "SKIP"
    assert "FAIL" not in status.values()
    # Each GPU row says what it runs on a GPU (TE, bf16, FP8 there) and why it is skipped here.
    text = proc.stdout
    assert text.count("skipped here: no CUDA device") >= len(expected) - 1
    assert "--fp8-recipe delayed" in text and "--fp8-recipe tensorwise" in text
    assert "torchrun --standalone --nproc_per_node 1 pretrain_looplm.py" in text
    # The resumed iterations equal the straight run bit for bit on CPU.
    smoke = next(r for r in summary["rows"] if r["row"].startswith("smoke: resumed"))
    assert smoke["numbers"]["max_diff"] == 0 and len(smoke["numbers"]["pairs"]) == 3
    # Everything stays in the output directory: logs of every row, the checkpoint, the table.
    assert (out / "worker.log").exists()
    for r in summary["rows"]:
        assert r["log"] is None or os.path.exists(r["log"]), r
    assert sum(r["log"] is not None for r in summary["rows"]) >= 1 + 8 + 3 + 2
    assert (out / "smoke" / "ckpt" / "iter_0000005").is_dir()
    assert (out / "summary.md").read_text().startswith("| row | status |")


def test_every_gpu_command_line_passes_validation_on_a_gpu(monkeypatch, tmp_path):
    """The flag lists as a GPU runs them pass megaloop's validation there (validation told a
    GPU with Transformer Engine exists; nothing is built), with the precision each row claims."""
    import torch

    from megaloop.training.run_config import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megaloop.training.run_config._te_installed", lambda: True)
    monkeypatch.setattr("megaloop.training.run_config.torch_capability", lambda: (9, 0))
    argvs = [a for _, _, local, te in rows.grads_runs() for a in (local, te)]
    smoke = rows.smoke_runs(str(tmp_path))
    argvs += [smoke[k] for k in ("first", "resume", "straight")]
    compare = rows.STEPS[True][0]
    assert compare == 10  # the FP8 rows compare the first 10 steps, as the README says
    for key, (argv, steps, warmup) in rows.timed_runs(True).items():
        # At least 20 timed steps after the warm-up; the FP8 comparison steps are warm-up.
        assert steps - warmup >= 20 and (warmup >= compare or "expected" not in key), key
        cfg = parse_args(argv)
        cfg.validate(world_size=1)
        assert cfg.training.bf16 and cfg.model.transformer_impl == "transformer_engine", key
        assert cfg.training.train_iters == steps
        assert (cfg.model.fp8_format is not None) == ("fp8" in key), key
        assert cfg.loop.effective_depth(cfg.model.num_layers) == 24, key
    for argv in argvs:
        parse_args(argv).validate(world_size=1)
    # The three smoke launches differ only in saving, loading and their logs: one schedule, so
    # the resume continues what was saved (a changed one is refused at load).
    def drop(argv, flags):
        out, i = [], 0
        while i < len(argv):
            if argv[i] in flags:
                i += 2
            else:
                out, i = out + [argv[i]], i + 1
        return out

    same = drop(smoke["straight"], {"--log-jsonl"})
    assert drop(smoke["first"], {"--save", "--save-interval", "--exit-interval",
                                 "--log-jsonl"}) == same
    assert drop(smoke["resume"], {"--load", "--log-jsonl"}) == same


def test_cpu_flags_swap_only_the_gpu_flags():
    gpu = ["--hidden-size", "2048", "--bf16", "--transformer-impl", "transformer_engine",
           "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--train-iters", "7",
           "--lr-decay-iters", "7", "--num-layers", "24", "--save", "/c", "--exit-interval", "5"]
    assert rows.cpu_flags(gpu) == [
        "--hidden-size", "64", "--transformer-impl", "local", "--train-iters", "7",
        "--lr-decay-iters", "7", "--num-layers", "8", "--save", "/c", "--exit-interval", "5",
        "--distributed-backend", "gloo"]


def _run(losses, applied, fwd_bwd=100.0):
    return {"losses": losses, "applied": applied, "flops_per_iter": 1e12,
            "tokens_per_iter": 1000, "mem_gib": None, "layout": "x",
            "ms": [{"fwd_bwd": fwd_bwd, "optim": 10.0, "step": fwd_bwd + 10.0}] * len(losses)}


def test_rows_check_their_own_run_before_reporting_a_number():
    ok = _run([6.0, 5.9, 5.8], [True] * 3)
    assert rows.steps_verdict(ok, "r") == []
    # A skipped step (an FP8 run whose NaN steps the trainer skipped is faster, not better).
    assert "skipped) at [2]" in rows.steps_verdict(_run([6.0, 5.9, 5.8], [True, False, True]),
                                                   "r")[0]
    assert "non-finite" in rows.steps_verdict(_run([6.0, float("nan"), 5.8], [True] * 3),
                                              "r")[0]
    # FP8 against bf16: within 3% per step passes, a NaN or a 10% gap fails.
    good, detail, numbers = rows.fp8_verdict(_run([6.06, 5.95, 5.8], [True] * 3), ok, 3, "t")
    assert good and abs(numbers["max_rel_diff"] - 0.01) < 1e-12 and numbers["at_step"] == 1
    assert not rows.fp8_verdict(_run([6.6, 5.9, 5.8], [True] * 3), ok, 3, "t")[0]
    assert not rows.fp8_verdict(_run([6.0, float("nan"), 5.8], [True] * 3), ok, 3, "t")[0]
    assert not rows.fp8_verdict(_run([6.0, 5.9, 5.8], [True, True, False]), ok, 3, "t")[0]
    # Throughput over the steps after the warm-up: 1000 tokens per 110 ms step, 1e12 FLOP per
    # 100 ms forward+backward = 10 TFLOP/s, 1% of a 1000 TFLOP/s peak.
    m = rows.throughput(_run([1.0] * 4, [True] * 4), 1, 1000e12)
    assert m["timed_steps"] == 3 and abs(m["tokens_per_s"] - 1000 / 0.11) < 1e-6
    assert abs(m["tflops_fwd_bwd"] - 10.0) < 1e-9 and abs(m["mfu_fwd_bwd"] - 0.01) < 1e-12


def test_grads_verdict_catches_one_step_share_of_the_gradient():
    """The hazard the gradient rows guard: a TE linear that overwrites instead of accumulating
    over the T = 3 calls keeps about one step's share of the core's weight gradient."""
    import torch

    g = torch.randn(1000, dtype=torch.float64)
    share = g * 0.5 + torch.randn(1000, dtype=torch.float64) * 0.8  # one step of three, roughly
    cos = float((g @ share) / (g.norm() * share.norm()))
    run = {"applied": [True, True], "loss_a": 6.9, "loss_b": 6.9, "step_losses_a": [7.0, 6.9],
           "step_losses_b": [7.0, 6.9], "init_max_diff": 0.0,
           "params": {"core.w": {"cos": cos, "rel": 0.6}, "emb": {"cos": 1.0, "rel": 0.0}}}
    for precision in ("bf16", "fp32"):
        ok, detail, _ = rows.grads_verdict(run, precision)
        assert not ok and "core.w" in detail, detail
    run["params"]["core.w"] = {"cos": 0.99995, "rel": 1e-3}
    run["loss_b"] = 6.9 + 0.02  # under the bf16 spacing at 6.9 (2 ** (2 - 7) = 0.03125)
    assert rows.grads_verdict(run, "bf16")[0]
    run["loss_b"] = 6.9 + 0.04
    assert not rows.grads_verdict(run, "bf16")[0]


def test_failing_torchrun_row_shows_the_python_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        def load_the_thing():
            raise ValueError("deliberate failure in a rank")

        if __name__ == "__main__":
            load_the_thing()
    """))
    log = str(tmp_path / "row.log")
    done = procs.run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "1", str(script)], log, 120, str(tmp_path),
                            dict(os.environ), "fails")
    text = open(log).read()
    assert done.rc != 0 and not done.timed_out
    assert "ChildFailedError" in text[-3000:]  # torchrun's banner ends the log ...
    assert "deliberate failure" not in text[-300:]  # ... so its tail alone names no reason
    shown = procs.failure_text(text)
    assert shown.startswith("Traceback (most recent call last):"), shown
    assert "in load_the_thing" in shown and "ValueError: deliberate failure in a rank" in shown
    assert "ChildFailedError" not in shown


def test_refusal_without_traceback_shows_the_error_line_not_the_banner():
    log = ("> CPU development mode\nerror: --lr-decay-iters 3 is shorter than ...\n"
           "E1201 12:00:00 api.py:1002] failed (exitcode: 2) local_rank: 0\n"
           "Traceback (most recent call last):\n  File \"run.py\", line 1, in <module>\n"
           "    main()\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "=====\npretrain_looplm.py FAILED\n")
    shown = procs.failure_text(log)
    assert "error: --lr-decay-iters 3" in shown and "ChildFailedError" not in shown


def test_failing_worker_row_shows_the_traceback(tmp_path):
    from megaloop.gpu_check.worker import Worker

    worker = Worker(str(tmp_path), dict(os.environ))
    try:
        log = str(tmp_path / "row.log")
        reply, timed_out = worker.call("json:loads", {"s": "{not json"}, log, 60)
        assert not timed_out and not reply["ok"]
        for text in (reply["error"], open(log).read()):
            assert "Traceback (most recent call last):" in text
            assert "json.decoder.JSONDecodeError" in text
        # The same worker answers the next row.
        reply, _ = worker.call("json:loads", {"s": "[1, 2]"}, log, 60)
        assert reply == {"ok": True, "value": [1, 2]}
    finally:
        worker.close()


def test_failing_row_prints_the_traceback_and_records_a_fail(tmp_path, capsys):
    from megaloop.gpu_check.main import Check

    check = Check(str(tmp_path), budget_s=300)
    try:
        assert check.in_worker("a row that fails", "json:loads", {"s": "{not json"}, 60) is None
    finally:
        check.worker.close()
    out = capsys.readouterr().out
    assert "Traceback (most recent call last):" in out and "JSONDecodeError" in out
    assert "full log: " in out
    row = json.load(open(tmp_path / "summary.json"))["rows"][-1]
    assert row["row"] == "a row that fails" and row["status"] == "FAIL"
    assert "JSONDecodeError" in open(row["log"]).read()


def test_timed_out_row_leaves_no_process_behind(tmp_path):
    # A launcher like torchrun: its worker runs in a session of its own, so killing the
    # launcher's process group would leave it running.
    pids = tmp_path / "pids"
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        open({str(pids)!r}, "w").write(f"{{child.pid}}\\n")
        print("launcher started its worker", file=sys.stderr, flush=True)
        if sys.argv[1] == "wait":
            time.sleep(600)
    """))
    log = str(tmp_path / "row.log")
    done = procs.run_logged([sys.executable, str(script), "wait"], log, 5, str(tmp_path),
                            dict(os.environ), "sleeper")
    assert done.rc == 124 and done.timed_out
    text = open(log).read()
    assert "launcher started its worker" in text and "timed out after 5 s" in text
    child = int(pids.read_text())
    assert not _alive(child)
    # The launcher exits on its own but leaves its worker: killed when the row ends.
    done = procs.run_logged([sys.executable, str(script), "exit"], log, 60, str(tmp_path),
                            dict(os.environ), "orphan")
    assert done.rc == 0 and not _alive(int(pids.read_text()))


def test_timed_out_worker_row_kills_the_worker_and_its_children(tmp_path):
    from megaloop.gpu_check.worker import Worker

    worker = Worker(str(tmp_path), dict(os.environ))
    log = str(tmp_path / "row.log")
    reply, timed_out = worker.call("subprocess:run", {"args": ["sleep", "600"]}, log, 3)
    assert reply is None and timed_out
    time.sleep(0.5)
    assert worker.proc is None and not procs.tagged_pids(worker.tag)
    assert "timed out after 3 s" in open(log).read()


# --- the defects -------------------------------------------------------------------------------
NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
TE_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
          "--global-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "128", "--train-iters", "1", "--bf16"]


def _on_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megaloop.training.run_config._te_installed", lambda: True)
    monkeypatch.setattr("megaloop.training.run_config.torch_capability", lambda: (9, 0))


@pytest.mark.parametrize("backend,expected", [
    # Megatron-LM's arguments.py: the chosen backend on, the other two off.
    ("flash", ("1", "0", "0")), ("fused", ("0", "1", "0")), ("unfused", ("0", "0", "1"))])
def test_attention_backend_sets_te_environment(monkeypatch, backend, expected):
    from megaloop.training.run_config import parse_args

    _on_a_gpu(monkeypatch)
    for name in NVTE:
        monkeypatch.delenv(name, raising=False)
    parse_args([*TE_RUN, "--transformer-impl", "transformer_engine", "--attention-backend",
                backend]).validate(world_size=1)
    assert tuple(os.environ.get(n) for n in NVTE) == expected


@pytest.mark.parametrize("backend,impl", [("auto", "transformer_engine"), ("local", "local")])
def test_attention_backend_auto_and_local_leave_the_environment(monkeypatch, backend, impl):
    from megaloop.training.run_config import parse_args

    _on_a_gpu(monkeypatch)
    for name, value in zip(NVTE, ("0", "1", "0")):  # a user's own choice stays
        monkeypatch.setenv(name, value)
    parse_args([*TE_RUN, "--transformer-impl", impl, "--attention-backend", backend]
               ).validate(world_size=1)
    assert tuple(os.environ.get(n) for n in NVTE) == ("0", "1", "0")


def test_attention_backend_environment_is_set_before_te_is_imported(monkeypatch):
    """With --transformer-impl auto, validation imports transformer_engine to resolve the spec:
    by then TE's variables must already be set (TE reads its debug switches at import)."""
    from megaloop.training.run_config import parse_args

    _on_a_gpu(monkeypatch)
    for name in NVTE:
        monkeypatch.delenv(name, raising=False)
    seen = []

    class RecordTEImport:
        def find_spec(self, name, path=None, target=None):
            if name == "transformer_engine":
                seen.append(tuple(os.environ.get(n) for n in NVTE))
                raise ImportError("no Transformer Engine on this machine")
            return None

    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [RecordTEImport(), *sys.meta_path])
    with pytest.raises(ValueError, match="--attention-backend fused"):  # TE did not import
        parse_args([*TE_RUN, "--transformer-impl", "auto", "--attention-backend", "fused"]
                   ).validate(world_size=1)
    assert seen and seen[0] == ("0", "1", "0")


def test_trainer_sets_the_attention_backend_before_megatron_core_imports_te():
    """pretrain_looplm.py: ``import megatron.core`` imports Transformer Engine (its utils try
    it), so the variables are set right after argument parsing. A fresh interpreter records them
    at the first attempt to import megatron-core or TE, and stops there."""
    code = textwrap.dedent(f"""
        import os, sys
        class RecordFirstImport:
            def find_spec(self, name, path=None, target=None):
                if name in ("megatron", "transformer_engine"):
                    print("RESULT", name, tuple(os.environ.get(n) for n in {NVTE!r}), flush=True)
                    os._exit(0)
                return None
        sys.meta_path.insert(0, RecordFirstImport())
        sys.path.insert(0, {ROOT!r})
        import pretrain_looplm
        pretrain_looplm.main(["--attention-backend", "unfused", "--mock-data",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
        print("RESULT none imported", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k not in NVTE}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300).stdout
    assert "RESULT megatron ('0', '0', '1')" in out, out


def test_context_parallel_without_bf16_is_refused(monkeypatch):
    from megaloop.training.run_config import parse_args

    _on_a_gpu(monkeypatch)
    fp32 = [a for a in TE_RUN if a != "--bf16"]
    cp = ["--transformer-impl", "transformer_engine", "--context-parallel-size", "2"]
    with pytest.raises(ValueError) as err:
        parse_args([*fp32, *cp]).validate(world_size=2)
    msg = str(err.value)
    assert "--context-parallel-size 2 needs --bf16" in msg and "add --bf16" in msg
    assert "\n" not in msg
    parse_args([*TE_RUN, *cp]).validate(world_size=2)  # with --bf16 it passes


def test_context_parallel_without_bf16_exits_2_before_any_process_group(monkeypatch, capsys):
    import torch

    import pretrain_looplm

    _on_a_gpu(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 0 of a torchrun launch of 2
    monkeypatch.setenv("RANK", "0")
    started = []
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: started.append(1))
    fp32 = [a for a in TE_RUN if a != "--bf16"]
    rc = pretrain_looplm.main([*fp32, "--transformer-impl", "transformer_engine",
                               "--context-parallel-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not started
    assert len(err) == 1 and err[0].startswith("error: --context-parallel-size 2 needs --bf16")


def test_gpu_check_uses_the_python_on_path_not_the_repository_venv(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho \"fake python3 $*\"\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    out = subprocess.run(["bash", SCRIPT, "--help"], env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert out.strip() == "fake python3 -m megaloop.gpu_check --help"
    # $PYTHON wins over PATH.
    env["PYTHON"] = str(fake)
    fake2 = tmp_path / "other"
    fake2.write_text("#!/bin/sh\necho other\n")
    fake2.chmod(0o755)
    env["PYTHON"] = str(fake2)
    out = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert out.strip() == "other"
