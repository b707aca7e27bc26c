"""The GPU check (``bash tools/gpu_check.sh`` = ``python -m megaloop.gpu_check``): every GPU-only
path of megaloop in one run that fits 10 minutes on one H100/H200, most informative rows
first, each row's full log kept in ``--output-dir``, a table and ``summary.json`` at the end.

Rows, in order: environment (versions, the attention backend TE picks); TE vs local gradients
at T = 3 in bf16 and in fp32; smoke (train 5 + save, resume to 7 under torchrun, equal to a
straight 7-iteration run); FP8 (`delayed`, `tensorwise`) against bf16 on the ~1B looped model,
with the proof that FP8 ran, and generation from an FP8-trained checkpoint; generation and
serving from the smoke checkpoint, TE's generation judged against the local build's logits, two
RL steps (megaloop.gpu_check.user_rows); throughput (looped `expected` / `last` vs the dense
twin, BF16 / FP8); ``pytest -m gpu`` if time is left.
Single-rank rows run in one long-lived worker (megaloop.gpu_check.worker), replaced by a fresh
one after any failed row; the resume runs under torchrun and the tools as processes of their
own, as a user launches them.

Exit status 1 if a correctness row failed; the performance goals (FP8 speed-up, looped/dense
MFU) are a section of their own, MET / NOT MET with the figure, and do not change it.

Without a GPU the same rows run as a rehearsal: the same command lines with the GPU-only flags
swapped (megaloop.gpu_check.rows.cpu_flags), tiny shapes, fewer timed steps; each row prints
what it runs on a GPU and why it is skipped here, and reads REHEARSED when its own checks passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from megaloop import runtime
from megaloop.gpu_check import procs, rows
from megaloop.gpu_check.report import Report, Result, say
from megaloop.gpu_check.user_rows import UserRows
from megaloop.gpu_check.worker import PY, ROOT, Worker

DEFAULT_BUDGET_S = 570.0
FIRST_CALL_S = 180.0  # a fresh worker's first row: imports, TE, cold compiles (>= 120 s)


class Check:
    def __init__(self, out_dir: str, budget_s: float):
        self.out, self.budget, self.t0 = out_dir, budget_s, time.time()
        # After any FAIL row the next single-rank row runs in a fresh worker: a failure can
        # leave the process unusable (a sticky CUDA error fails every later kernel launch, a
        # half-built model holds GPU memory, a wrong result may come from corrupted state),
        # which would turn every later row into an unrelated failure.
        self.report = Report(out_dir, on_fail=lambda: self.worker.close())
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    # TE's attention logger reads these at import: the worker imports TE.
                    "NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
        self.worker = Worker(out_dir, self.env)
        self.gpu = False
        self.n = 0
        self.big_started = False
        self.run_logs = {}
        self.last_secs, self.last_log = None, None
        self.done = {}  # CPU rehearsal: (fn, kwargs) -> (row, log, value) of the runs made

    # --- plumbing ------------------------------------------------------------------------------
    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def log_path(self, name: str) -> str:
        self.n += 1
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return os.path.join(self.out, f"{self.n:02d}_{safe}.log")

    def argv(self, flags: list) -> list:
        return list(flags) if self.gpu else rows.cpu_flags(flags)

    def status(self, ok: bool) -> str:
        return ("PASS" if self.gpu else "REHEARSED") if ok else "FAIL"

    def _time(self, cap: float):
        cap = cap + (FIRST_CALL_S if self.worker.fresh else 0.0)
        t = min(cap, self.left())
        return t if t >= 20 else None

    def show_gpu_command(self, name: str, command: str):
        if not self.gpu:
            say(f"{name}: on a GPU runs {command}\n[gpu_check]   skipped here: no CUDA device; "
                f"rehearsed with the GPU-only flags swapped (local spec, fp32, gloo, no FP8) "
                f"at tiny shapes")

    def fail(self, name: str, why: str, log: str | None, secs: float | None = None, **kw):
        text = why
        if log and os.path.exists(log):
            text = f"{why}\n{procs.failure_text(open(log, errors='replace').read())}"
        print("\n".join("    " + line for line in text.splitlines()), flush=True)
        if log:
            print(f"    full log: {log}", flush=True)
        self.report.add(Result(name, "FAIL", why, secs, log=log, **kw))

    def in_worker(self, name: str, fn: str, kwargs: dict, cap: float, command: str = ""):
        """Run ``fn(**kwargs)`` in the worker as row ``name``; its value, or None after a FAIL
        row (with the traceback printed)."""
        self.show_gpu_command(name, command) if command else None
        key = json.dumps([fn, kwargs], sort_keys=True)
        if not self.gpu and key in self.done:
            # The swap made two GPU command lines one (bf16 and fp32, FP8 and bf16): run once.
            first, self.last_log, value = self.done[key]
            self.last_secs = 0.0
            say(f"{name}: the same CPU command line as '{first}'; its result reused")
            return value
        log = self.log_path(name)
        t = self._time(cap)
        if t is None:
            self.report.add(Result(name, "FAIL", f"not run: out of time (budget "
                                                 f"{self.budget:.0f} s)", log=None))
            return None
        start = time.time()
        reply, timed_out = self.worker.call(f"megaloop.gpu_check.probes:{fn}" if ":" not in fn
                                            else fn, kwargs, log, t)
        secs = time.time() - start
        self.last_secs, self.last_log = secs, log
        if reply is None:
            self.fail(name, f"timed out after {t:.0f} s" if timed_out else "worker died", log,
                      secs, gpu_command=command or None)
            return None
        if not reply["ok"]:  # (the FAIL row also replaces the worker: Report.on_fail)
            self.fail(name, reply["error"].strip().splitlines()[-1], log, secs,
                      gpu_command=command or None)
            return None
        self.done[key] = (name, log, reply["value"])
        return reply["value"]

    def torchrun(self, name: str, argv: list, cap: float) -> procs.Finished | None:
        log = self.log_path(name)
        t = min(cap, self.left())
        if t < 20:
            self.report.add(Result(name, "FAIL", f"not run: out of time (budget "
                                                 f"{self.budget:.0f} s)"))
            return None
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               os.path.join(ROOT, "pretrain_looplm.py"), *argv]
        env = dict(self.env)
        if "--attention-backend" in argv:  # as each rank does: before TE is imported
            runtime.set_attention_backend_env(argv[argv.index("--attention-backend") + 1], env)
        return procs.run_logged(cmd, log, t, ROOT, env, name)

    # --- the rows ---------------------------------------------------------------------------------
    def run(self) -> int:
        say(f"output directory {self.out} (send it back whole if a row fails)")
        info = self.environment()
        self.grads()
        ckpt = self.smoke()
        # The FP8 rows right after the smoke rows: rows past the budget are reported as not run,
        # and FP8 is what a borrowed GPU exists to check (its proof that FP8 ran has no CPU
        # stand-in), so no slow tool start or RL step ahead of it may crowd it out.
        runs = self.fp8()
        user = UserRows(self)
        user.fp8_checkpoint()
        if ckpt:
            user.generate_and_serve(ckpt)
        else:
            self.report.add(Result("generate and serve: smoke checkpoint", "FAIL",
                                   "not run: the smoke row saved no checkpoint"))
        user.rl()
        self.throughput(runs, info)
        self.pytest()
        self.worker.close()
        where = f"{info.get('gpus', 0)} x {info.get('gpu')}" if self.gpu else \
            "no GPU: CPU rehearsal of every GPU row"
        print(f"\nmegaloop GPU check: {where}, {time.time() - self.t0:.0f} s, "
              f"logs in {self.out}\n")
        print(self.report.table())
        print(f"\nsummary: {os.path.join(self.out, 'summary.json')}")
        return self.report.exit_status()

    def environment(self) -> dict:
        shape = {"heads": 16, "head_dim": 128, "seq": 2048, "batch": 2}  # the BIG model's
        info = self.in_worker("environment", "environment", {"attention_shape": shape}, 0)
        if info is None:
            # Without the worker's answer, ask the driver: a GPU machine must not fall back to
            # the CPU rehearsal's flags.
            try:
                smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                     timeout=30)
                self.gpu = smi.returncode == 0 and "GPU" in smi.stdout
            except (OSError, subprocess.TimeoutExpired):
                self.gpu = False
            return {}
        self.gpu = bool(info["cuda"])
        self.report.header = {"environment": info, "gpu": self.gpu, "budget_s": self.budget}
        if self.gpu:
            log = open(self.last_log, errors="replace").read()
            picked = [line.strip() for line in log.splitlines()
                      if "Running with" in line or "Selected backend" in line
                      or "Available backends" in line]
            info["attention_backend_log"] = picked
            backend = "; ".join(list(dict.fromkeys(picked))[-3:]) or \
                "TE logged no backend choice (see the log)"
        else:
            say("environment: on a GPU also runs one causal bf16 attention forward+backward "
                "through TE's DotProductAttention (16 heads x 128, seq 2048) with NVTE_DEBUG=1 "
                "NVTE_DEBUG_LEVEL=2; skipped here: no CUDA device")
            backend = "no GPU"
        keys = ("torch", "cuda_runtime", "driver", "cudnn", "nccl", "transformer_engine",
                "megatron_core", "flash_attn", "gpu", "capability", "memory_gib")
        detail = ", ".join(f"{k} {info[k]}" for k in keys if k in info) + f"; TE attention: " \
            f"{backend}"
        probe_error = info.get("attention_probe_error")
        if self.gpu and not info.get("transformer_engine"):
            probe_error = ("Transformer Engine does not import: "
                           f"{info.get('transformer_engine_import_error', 'not installed')}")
        if probe_error:
            self.fail("environment", f"TE attention probe: "
                      f"{probe_error.strip().splitlines()[-1]}; {detail}", self.last_log,
                      self.last_secs, numbers=info)
        else:
            self.report.add(Result("environment", "INFO", detail, self.last_secs, numbers=info,
                                   log=self.last_log))
        return info

    def grads(self):
        for precision, variant, local, te in rows.grads_runs():
            name = f"TE vs local grads {precision} T=3: {variant}"
            command = (f"one step of pretrain_looplm.py {shlex.join(te)} against the same with "
                       f"--transformer-impl local, the local weights copied in")
            # The first row builds megatron-core models for the first time: its import and
            # the cold torch.compile of the fused kernels.
            cap = 150 if variant == next(iter(rows.VARIANTS)) else 60
            r = self.in_worker(name, "grads", {"argv_a": self.argv(local),
                                               "argv_b": self.argv(te)}, cap, command)
            if r is None:
                continue
            ok, detail, numbers = rows.grads_verdict(r, precision)
            self.report.add(Result(name, self.status(ok), detail, self.last_secs,
                                   numbers=numbers, log=self.last_log, gpu_command=command))

    def smoke(self) -> str | None:
        """The smoke rows; the checkpoint they saved (iteration 5), None if none was."""
        d = os.path.join(self.out, "smoke")
        os.makedirs(d, exist_ok=True)
        runs = rows.smoke_runs(d)
        ckpt = runs["ckpt"]

        name = "smoke: train 5 + eval + save (bf16 TE, T=3)"
        rc = self.in_worker(name, "pretrain", {"argv": self.argv(runs["first"])}, 90,
                            f"pretrain_looplm.py {shlex.join(runs['first'])} (in the worker)")
        if rc is None:
            return
        first = rows.train_records(os.path.join(d, "first.jsonl"))
        problems = rows.smoke_verdict(first, [1, 2, 3, 4, 5], rc, "train 5")
        if not os.path.isdir(os.path.join(ckpt, "iter_0000005")):
            problems.append("no checkpoint iter_0000005")
        if not any(r["split"] == "valid" for r in first):
            problems.append("no validation record")
        if problems:
            return self.fail(name, "; ".join(problems), self.last_log, self.last_secs)
        train = [r for r in first if r["split"] == "train"]
        self.report.add(Result(name, self.status(True), f"loss {train[0]['loss']:.4f} -> "
                               f"{train[-1]['loss']:.4f}, saved iter_0000005", self.last_secs,
                               log=self.last_log))
        self.resume(runs, d)
        return ckpt

    def resume(self, runs: dict, d: str):
        ckpt = runs["ckpt"]

        name = "smoke: resume 5 -> 7 under torchrun"
        self.show_gpu_command(name, "torchrun --standalone --nproc_per_node 1 pretrain_looplm.py "
                              + shlex.join(runs["resume"]))
        done = self.torchrun(name, self.argv(runs["resume"]), 150)
        if done is None:
            return
        text = open(done.log, errors="replace").read()
        resumed = rows.train_records(os.path.join(d, "resume.jsonl"))
        problems = rows.smoke_verdict(resumed, [6, 7], done.rc, "resume")
        if done.timed_out:
            problems.insert(0, f"timed out after {done.seconds:.0f} s")
        if f"loaded {ckpt}/iter_0000005" not in text:
            problems.append(f"no 'loaded {ckpt}/iter_0000005' line")
        if problems:
            return self.fail(name, "; ".join(problems), done.log, done.seconds)
        self.report.add(Result(name, self.status(True), "loaded iter_0000005, trained 6-7",
                               done.seconds, log=done.log))

        name = "smoke: resumed 6-7 equal a straight 7-iteration run"
        rc = self.in_worker(name, "pretrain", {"argv": self.argv(runs["straight"])}, 90,
                            f"pretrain_looplm.py {shlex.join(runs['straight'])} (in the worker)")
        if rc is None:
            return
        straight = rows.train_records(os.path.join(d, "straight.jsonl"))
        problems = rows.smoke_verdict(straight, list(range(1, 8)), rc, "straight 7")
        if problems:
            return self.fail(name, "; ".join(problems), self.last_log, self.last_secs)
        split = lambda recs, s: [r["loss"] for r in recs if r["split"] == s]  # noqa: E731
        pairs = list(zip(split(resumed, "train"), split(straight, "train")[5:]))
        pairs += list(zip(split(resumed, "valid")[-1:], split(straight, "valid")[-1:]))
        diff = max(abs(a - b) for a, b in pairs)
        # Bitwise without a GPU. On a GPU, TE's attention backward may accumulate in another
        # order from one launch to the next (TE allows non-deterministic kernels by default),
        # so the resumed losses may differ by rounding: up to the bf16 resolution of the loss.
        tol = rows.bf16_resolution(pairs[0][1]) if self.gpu else 0.0
        detail = (f"iterations 6, 7 and the final validation: max |resumed - straight| "
                  f"{diff:.3g} ({'bitwise equal' if diff == 0 else 'not bitwise'}; tolerance "
                  f"{f'{tol:.2g} (bf16 resolution)' if tol else 'bitwise'})")
        self.report.add(Result(name, self.status(diff <= tol), detail, self.last_secs,
                               numbers={"pairs": pairs, "max_diff": diff, "tolerance": tol},
                               log=self.last_log))

    def _train(self, name: str, argv: list, steps: int, **grads):
        command = f"{steps} timed steps of pretrain_looplm.py {shlex.join(argv)} (in the worker)"
        # The first large run compiles the fused kernels for its shapes.
        cap, self.big_started = (90 if self.big_started else 150), True
        return self.in_worker(name, "train_steps", {"argv": self.argv(argv), "steps": steps,
                                                    **grads}, cap, command)

    def fp8(self) -> dict:
        """The bf16 reference and the FP8 runs on the looped model; a row per recipe from their
        first steps. Returns every run made (the throughput rows time their later steps)."""
        compare = rows.STEPS[self.gpu][0]
        runs = {}
        # The bf16 run's first-step gradient of one core weight, for the FP8 runs to compare
        # with (tens of MB at the ~1B shape: removed once they have).
        grad_file = os.path.join(self.out, "bf16_first_step_grad.pt")
        for key, (argv, steps, _) in rows.timed_runs(self.gpu).items():
            if not key.startswith("looped-expected"):
                continue
            recipe = key.rsplit("-", 1)[-1]
            name = ("run: " + key) if recipe == "bf16" else \
                f"FP8 {recipe}: {compare} steps vs bf16 (looped 6 x 4)"
            # (No bf16 gradient when its run failed: the FP8 row then says so, below.)
            grads = {"grad_save": grad_file} if recipe == "bf16" else \
                {"grad_compare": grad_file} if os.path.exists(grad_file) else {}
            r = runs[key] = self._train(name, argv, steps, **grads)
            self.run_logs[key] = self.last_log
            if r is None or recipe == "bf16":
                continue
            bf16 = runs["looped-expected-bf16"]
            if bf16 is None:
                self.report.add(Result(name, "FAIL", "no bf16 reference run"))
                continue
            ok, detail, numbers = rows.fp8_verdict(r, bf16, compare, recipe, self.gpu)
            if not self.gpu:
                detail = "FP8 flags dropped on CPU: " + detail
            numbers["timings_s"] = r.get("timings_s")
            self.report.add(Result(name, self.status(ok), detail, self.last_secs,
                                   numbers=numbers, log=self.last_log))
        if os.path.exists(grad_file):
            os.remove(grad_file)
        return runs

    def throughput(self, runs: dict, info: dict):
        planned = rows.timed_runs(self.gpu)
        for key, (argv, steps, _) in planned.items():
            if key not in runs:
                runs[key] = self._train(f"run: {key}", argv, steps)
                self.run_logs[key] = self.last_log
        peak = rows.peak_flops(info.get("gpu", ""), os.environ.get("GPU_CHECK_PEAK_TFLOPS"))
        measured = {}
        for key, r in runs.items():
            if r is None:
                continue
            name = f"throughput {key}"
            problems = rows.steps_verdict(r, key)
            if problems:
                self.report.add(Result(name, "FAIL", "; ".join(problems)))
                continue
            m = measured[key] = rows.throughput(r, planned[key][2], peak)
            m["timings_s"] = r.get("timings_s")  # build, first step, the rest: wall seconds
            mfu = "n/a (unknown GPU: set GPU_CHECK_PEAK_TFLOPS)" if m["mfu_fwd_bwd"] is None \
                else f"{100 * m['mfu_fwd_bwd']:.1f}% of BF16 peak"
            t = m["timings_s"]
            detail = (f"{m['tokens_per_s']:,.0f} tok/s; fwd+bwd {m['fwd_bwd_ms']:.1f} ms "
                      f"({m['tflops_fwd_bwd']:.1f} TFLOP/s, MFU {mfu}), optimizer "
                      f"{m['optim_ms']:.1f} ms, over {m['timed_steps']} steps; {m['layout']}"
                      + (f"; {m['mem_gib']:.1f} GiB" if m["mem_gib"] else "")
                      + f"; wall: build {t['build']:.1f} s, first step {t['first_step']:.1f} "
                        f"s, the rest {t['rest']:.1f} s")
            self.report.add(Result(name, "INFO" if self.gpu else "REHEARSED", detail,
                                   sum(t.values()), numbers=m, log=self.run_logs.get(key)))
        self._ratios(measured)

    def _ratios(self, m: dict):
        """The looped/dense MFU and FP8/BF16 speed-ups. Those with a goal go to the report's
        goals (MET / NOT MET with the figure, never the exit status); a GPU that misses one is
        slower than hoped, not broken."""
        for loop_key, goal in (("looped-last-bf16", rows.MFU_RATIO_GOAL),
                              ("looped-expected-bf16", None)):
            name = f"MFU {loop_key} / dense-bf16" + (f" >= {goal}" if goal else "")
            if loop_key not in m or "dense-bf16" not in m:
                self._goal_or_row(name, goal, None, "a throughput run is missing (its row "
                                  "says why)")
                continue
            ratio = m[loop_key]["tflops_fwd_bwd"] / m["dense-bf16"]["tflops_fwd_bwd"]
            self._goal_or_row(name, goal, ratio, f"{ratio:.3f} (forward+backward FLOP/s, one "
                              f"FLOP formula)")
        for fp8_key, bf16_key in (("looped-expected-fp8-tensorwise", "looped-expected-bf16"),
                                  ("looped-expected-fp8-delayed", "looped-expected-bf16"),
                                  ("dense-fp8-tensorwise", "dense-bf16")):
            name = f"tokens/s {fp8_key} / {bf16_key} >= {rows.FP8_SPEEDUP_GOAL}"
            if fp8_key not in m or bf16_key not in m:
                self._goal_or_row(name, rows.FP8_SPEEDUP_GOAL, None, "a throughput run is "
                                  "missing (its row says why)")
                continue
            up = m[fp8_key]["tokens_per_s"] / m[bf16_key]["tokens_per_s"]
            self._goal_or_row(name, rows.FP8_SPEEDUP_GOAL, up, f"{up:.2f}x")

    def _goal_or_row(self, name: str, goal: float | None, value: float | None, detail: str):
        numbers = {} if value is None else {"value": value, "goal": goal}
        if goal is None:  # a measurement without a goal is a row (INFO), as the throughput rows
            status = "FAIL" if value is None else ("INFO" if self.gpu else "REHEARSED")
            self.report.add(Result(name, status, detail, numbers=numbers))
        elif value is None or not self.gpu:
            why = "" if value is None else " (CPU rehearsal: judged on a GPU only)"
            self.report.add_goal(Result(name, "NOT JUDGED", detail + why, numbers=numbers))
        else:
            self.report.add_goal(Result(name, "MET" if value >= goal else "NOT MET", detail,
                                        numbers=numbers))

    def pytest(self):
        name = "pytest -m gpu tests"
        cmd = [PY, "-m", "pytest", "-m", "gpu", "tests", "-q", "-rfEs", "-p", "no:cacheprovider"]
        if not self.gpu:
            say(f"{name}: on a GPU runs {shlex.join(['python', *cmd[1:]])} if time is left; "
                f"skipped here: "
                f"no CUDA device (every gpu-marked test needs one)")
            self.report.add(Result(name, "SKIP", "no GPU", gpu_command=shlex.join(cmd)))
            return
        self.worker.close()  # the tests need the GPU's memory
        if self.left() < 60:
            self.report.add(Result(name, "SKIP", f"out of time ({self.left():.0f} s left)"))
            return
        log = self.log_path(name)
        done = procs.run_logged(cmd, log, self.left(), ROOT, self.env, name)
        text = open(log, errors="replace").read()
        summary = [line.strip("= ") for line in text.splitlines()
                   if any(w in line for w in (" passed", " failed", " error", " skipped"))]
        detail = summary[-1] if summary else f"rc {done.rc}"
        if done.rc != 0:
            return self.fail(name, f"rc {done.rc}{' (timed out)' if done.timed_out else ''}: "
                             f"{detail}", log, done.seconds)
        self.report.add(Result(name, "PASS", detail, done.seconds, log=log))



def interpreter_problem() -> str | None:
    """One line saying that this interpreter cannot run the check (torch does not import) and
    how to choose another, or None. Checked before any row: every row would otherwise fail
    with the same ImportError traceback."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return None
    found = os.environ.get("GPU_CHECK_PYTHON_FROM")
    return (f"error: the interpreter {sys.executable} (Python {sys.version.split()[0]}"
            f"{f', from {found}' if found else ''}) cannot import torch, so it cannot run the "
            f"GPU check; choose the one that has torch and megatron-core: "
            f"PYTHON=/path/to/python bash tools/gpu_check.sh")


def main(argv=None) -> int:
    # `megaloop gpu-check` names itself (megaloop/cli/main.py sets argv[0]); `python -m` does not
    prog = sys.argv[0] if sys.argv[0].startswith("megaloop ") else "tools/gpu_check.sh"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=None,
                        help="where every row's log, the checkpoints, summary.md and "
                             "summary.json go (default: gpu_check_<date>-<time> in the "
                             "current directory); send it back whole when a row fails")
    parser.add_argument("--budget-s", type=float,
                        default=float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)),
                        help="wall-clock budget for all rows (default 570, or "
                             "$GPU_CHECK_BUDGET_S)")
    args = parser.parse_args(argv)
    missing = interpreter_problem()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    out = os.path.abspath(args.output_dir or time.strftime("gpu_check_%Y%m%d-%H%M%S"))
    if os.path.isdir(out) and os.listdir(out):
        print(f"error: --output-dir {out} is not empty; name a new directory", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    check = Check(out, args.budget_s)
    try:
        return check.run()
    finally:
        check.worker.close()
