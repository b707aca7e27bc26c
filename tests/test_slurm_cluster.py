"""examples/slurm/pretrain_looplm.sbatch on a real two-node SLURM cluster: completion, every way a
job is stopped early (a signal to the job steps, to the batch shell, to every process of the job;
a requeue; the time limit; a signal during the start-up), a node's launcher killed, and the
resubmission after each.

The cluster is tools/slurm_test_cluster.sh's (slurmctld and two slurmd daemons on this machine);
.ci/run's "real SLURM" stage starts it and sets MEGALOOP_SLURM_CLUSTER=1, without which these
tests are skipped (conftest.py). The script runs unchanged, submitted the way its header says
(`bash pretrain_looplm.sbatch [sbatch options]`), sized for the CPU through its knobs:
GPUS_PER_NODE=0 (one rank per node on a partition without GPUs), mock data, a tiny model and gloo
in EXTRA_ARGS. Each node's torchrun joins the c10d rendezvous on node1, so every job is DP=2
across the two nodes.

The independent reference is one uninterrupted 2-rank run of the same flags on one node
(pretrain_looplm.main on two forked gloo ranks), the flags read from a running rank's command
line. A job stopped early and its resubmission, their JSONL joined (the records a killed job
logged after its last checkpoint are not kept, as the script says), must equal it exactly.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from distributed import console_of, free_port, run_distributed, run_main

pytestmark = pytest.mark.slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "examples", "slurm", "pretrain_looplm.sbatch")
SCRIPT = os.path.join(ROOT, "pretrain_looplm.py")
TRAIN_ITERS = 20
TINY = ("--num-layers 2 --num-loops 3 --hidden-size 32 --num-attention-heads 4 "
        "--ffn-hidden-size 88 --seq-length 32 --max-position-embeddings 32 --vocab-size 200 "
        "--tensor-model-parallel-size 1 --distributed-backend gloo --bf16 false "
        "--num-workers 0 --log-interval 1 --eval-interval 5 --eval-iters 1 "
        "--lr-warmup-iters 5 --hidden-dropout 0.1")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


# --- submitting and watching jobs ----------------------------------------------------------------
class Job:
    def __init__(self, job_id: str, run_dir, ckpt_dir):
        self.id, self.run_dir, self.ckpt_dir = job_id, run_dir, ckpt_dir
        self.metrics = run_dir / "metrics.jsonl"

    def info(self) -> dict:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True,
                             text=True, check=True).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def log(self) -> str:
        logs = sorted(self.run_dir.glob(f"*-{self.id}.out"))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def records(self) -> list:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines()
                if line.strip()]

    def status(self) -> dict:
        return json.loads((self.run_dir / "exit_status.json").read_text())

    def wait(self, timeout: float = 300) -> dict:
        """Until the job has ended (not requeued, not completing); its scontrol record."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.info()
            if info.get("JobState") in ENDED and "COMPLETING" not in info.get("Reason", ""):
                if not self._completing():
                    return info
            time.sleep(0.5)
        subprocess.run(["scancel", self.id])
        raise AssertionError(f"job {self.id} did not end\n{self.log()[-6000:]}")

    def _completing(self) -> bool:
        out = subprocess.run(["squeue", "-h", "-j", self.id, "-o", "%T"], capture_output=True,
                             text=True).stdout
        return "COMPLETING" in out

    def wait_iteration(self, iteration: int, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(r["split"] == "train" and r["iteration"] >= iteration
                   for r in self.records()):
                return
            if self.info().get("JobState") in ENDED:
                break
            time.sleep(0.1)
        raise AssertionError(f"job {self.id} never reached iteration {iteration}\n"
                             f"{self.log()[-6000:]}")

    def processes(self, name: str, **env) -> list:
        """Pids of this job's processes whose command line holds ``name`` and whose environment
        has ``env`` (e.g. SLURMD_NODENAME="node2")."""
        want = dict(env, SLURM_JOB_ID=self.id)
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().split(b"\0")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                                   if b"=" in item)
            except OSError:
                continue
            if any(name.encode() in part for part in cmdline) and all(
                    environ.get(k.encode()) == v.encode() for k, v in want.items()):
                found.append((int(pid), [p.decode() for p in cmdline if p]))
        return found


def submit(tmp_path, name: str, *sbatch_args, ckpt: str = "checkpoints", **knobs) -> Job:
    """The script submits itself with the knobs in its environment; returns the job."""
    run_dir, ckpt_dir = tmp_path / "runs" / name, tmp_path / ckpt
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    env = dict(os.environ, PATH=path, GPUS_PER_NODE="0", OMP_NUM_THREADS="1",
               MASTER_PORT=str(free_port()), MOCK_DATA="true", TENSORBOARD_DIR="",
               TRAIN_ITERS=str(TRAIN_ITERS), GLOBAL_BATCH_SIZE="8", MICRO_BATCH_SIZE="2",
               LR="3e-3", SAVE_INTERVAL="1000", OUTPUT_DIR=str(run_dir),
               CHECKPOINT_DIR=str(ckpt_dir), EXTRA_ARGS=TINY)
    env.update({k: str(v) for k, v in knobs.items()})
    for name_ in ("CONTAINER_IMAGE", "SLURM_JOB_ID", "EXIT_DURATION_MINS"):
        if name_ not in knobs:
            env.pop(name_, None)
    out = subprocess.run(["bash", SBATCH, "--parsable", "--nodes", "2", "--cpus-per-task=2",
                          *sbatch_args], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return Job(out.stdout.strip().split(";")[0], run_dir, ckpt_dir)


def tracker(ckpt_dir) -> int:
    return int((ckpt_dir / "latest_checkpointed_iteration.txt").read_text())


def key(r):
    return (r["split"], r["iteration"], r["loss"], tuple(r["step_losses"]))


# --- the plain job and the reference --------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One job run to completion; the flags its ranks ran (read while it ran); the reference: the
    same flags as one uninterrupted 2-rank run on one node."""
    tmp = tmp_path_factory.mktemp("plain")
    job = submit(tmp, "plain")
    job.wait_iteration(1)
    ranks = job.processes(SCRIPT, LOCAL_RANK="0")
    assert len(ranks) == 2, ranks  # one rank on each node
    argv = ranks[0][1]
    info = job.wait()
    flags = argv[argv.index(SCRIPT) + 1:]
    ref_dir = tmp / "reference"
    ref_dir.mkdir()
    swap = {str(job.ckpt_dir): str(ref_dir / "checkpoints"),
            str(job.metrics): str(ref_dir / "metrics.jsonl"),
            str(job.run_dir / "exit_status.json"): str(ref_dir / "exit_status.json")}
    flags = [swap.get(f, f) for f in flags]
    assert flags.count(str(ref_dir / "checkpoints")) == 2  # --save and --load
    codes = run_distributed(run_main, 2, flags, str(ref_dir), timeout=300)
    assert codes == [0, 0], "".join(console_of(ref_dir, 2))[-6000:]
    reference = [key(r) for r in Job("", ref_dir, None).records()]
    return job, info, reference


def test_two_nodes_to_completion_equal_one_node_run(plain):
    job, info, reference = plain
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert job.status()["status"] == "completed"
    assert "TP 1 CP 1 PP 1 DP 2" in log and "nodes=2 master=node1:" in log, log[-6000:]
    # The job log lies under OUTPUT_DIR (the script's own --output when it submits itself).
    assert (job.run_dir / f"looplm-1.4b-{job.id}.out").exists()
    assert [key(r) for r in job.records()] == reference
    # A normal end prints no traceback (torchrun's rendezvous shutdown on the second node) and no
    # library warning.
    for noise in ("Traceback", "recvVector", "Warning"):
        assert noise not in log, log[-6000:]


# --- stopped early, then resubmitted -----------------------------------------------------------------
def _resume_equals_reference(tmp_path, first: Job, reference, stopped: int, **knobs):
    """Resubmit; the second job resumes from ``stopped`` and trains to the end; the first job's
    records up to ``stopped`` joined with the second's equal the reference."""
    # Once the first job's processes are gone: a killed rank can outlive its job by a moment,
    # and while it runs it holds the --save folder's lock (megaloop.training.save_lock).
    deadline = time.time() + 60
    while first.processes(SCRIPT) and time.time() < deadline:
        time.sleep(0.2)
    second = submit(tmp_path, "resubmitted", **knobs)
    info = second.wait()
    log = second.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    resumed = (f"loaded {first.ckpt_dir}/iter_{stopped:07d}" if stopped else
               f"no checkpoint in --load {first.ckpt_dir}: starting from scratch")
    assert resumed in log, log[-6000:]
    kept = [r for r in first.records() if r["iteration"] <= stopped]
    assert [key(r) for r in kept + second.records()] == reference
    return log


def _signal_after(tmp_path, plain, *scancel_flags):
    _, _, reference = plain
    job = submit(tmp_path, "first")
    job.wait_iteration(3)
    subprocess.run(["scancel", *scancel_flags, "-s", "TERM", job.id], check=True)
    info = job.wait()
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    status = job.status()
    assert status["status"] == "saved-and-stopped", status
    stopped = tracker(job.ckpt_dir)
    assert 3 <= stopped < TRAIN_ITERS and status["checkpoint_iteration"] == stopped
    assert max(r["iteration"] for r in job.records()) == stopped
    # Each node's launcher says in one line that it passed the signal on (no traceback).
    assert log.count("SIGTERM received and passed on to its ranks") == 2, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    _resume_equals_reference(tmp_path, job, reference, stopped)
    return log


def test_sigterm_to_the_job_steps_saves_and_resumes(tmp_path, plain):
    _signal_after(tmp_path, plain)


def test_sigterm_to_the_batch_shell_saves_and_resumes(tmp_path, plain):
    log = _signal_after(tmp_path, plain, "--batch")
    assert "batch script: SIGTERM received" in log


def _failed_naming_the_kept_checkpoint(job: Job):
    """The job ended FAILED, its exit_status.json (the script's, the ranks never wrote one) and
    its log naming the checkpoint kept; returns that iteration and the status."""
    info = job.wait()
    log = job.log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", log[-6000:]
    kept = tracker(job.ckpt_dir)
    status = job.status()
    assert (status["status"], status["checkpoint_iteration"]) == ("failed", kept), status
    assert f"nothing after the last checkpoint ({kept}) is kept" in log, log[-6000:]
    return kept, status


def test_sigterm_to_every_process_says_what_is_kept_and_resumes(tmp_path, plain):
    """scancel --full also signals srun, which kills its job step at once (SLURM's own rule):
    the ranks cannot save. The job fails, saying so and naming the checkpoint that is kept;
    the resubmission resumes from it."""
    _, _, reference = plain
    job = submit(tmp_path, "first", SAVE_INTERVAL=2)
    job.wait_iteration(5)
    subprocess.run(["scancel", "--full", "-s", "TERM", job.id], check=True)
    kept, status = _failed_naming_the_kept_checkpoint(job)
    assert "srun itself is signalled" in status["reason"]
    # Its rank 0 was killed holding the --save lock, on either node; the resubmission's rank 0
    # (on either node) takes it over because SLURM says that job has ended, not after the
    # hour of --save-lock-timeout.
    left = (job.ckpt_dir / "megaloop_run.lock").exists()
    log = _resume_equals_reference(tmp_path, job, reference, kept)
    if left:
        assert f"SLURM job {job.id}, started" in log and \
            f"its SLURM job {job.id} has ended" in log, log[-6000:]


def test_requeued_job_resumes_by_itself(tmp_path, plain):
    _, _, reference = plain
    job = submit(tmp_path, "requeued")
    job.wait_iteration(3)
    subprocess.run(["scontrol", "requeue", job.id], check=True)
    # Back in the queue once its ranks have saved and left (SLURM gives them KillWait, 30 s).
    deadline = time.time() + 120
    while (job.info().get("JobState") != "PENDING" or job.processes(SCRIPT)) \
            and time.time() < deadline:
        time.sleep(0.2)
    stopped = tracker(job.ckpt_dir)
    assert 3 <= stopped < TRAIN_ITERS
    # A requeued job waits (SLURM's requeue delay, two minutes by default) before it may start.
    subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=True)
    info = job.wait()
    log = job.log()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        log[-6000:]
    assert f"loaded {job.ckpt_dir}/iter_{stopped:07d}" in log, log[-6000:]
    assert job.status()["status"] == "completed"
    # One job id, one OUTPUT_DIR: the requeued run appends to the same JSONL.
    assert [key(r) for r in job.records()] == reference


def test_time_limit_saves_from_the_jobs_own_end_time(tmp_path):
    """--time=3 and EXIT_MARGIN_MINS=2: the script derives --exit-duration-in-mins from the
    job's end time, and the run saves and stops about two minutes before it, well before SLURM
    would end the job (--signal is moved to the end so that it cannot be what stops the run)."""
    job = submit(tmp_path, "limited", "--time=3", "--signal=TERM@5", TRAIN_ITERS=100000,
                 EXIT_MARGIN_MINS=2)
    info = job.wait(timeout=300)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    status = job.status()
    assert status["status"] == "saved-and-stopped", status
    assert "--exit-duration-in-mins" in status["reason"], status
    assert status["checkpoint_iteration"] == tracker(job.ckpt_dir) == status["iteration"] > 0
    assert "the run saves and stops after" in log, log[-6000:]
    start = time.mktime(time.strptime(info["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    end = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert end - start < 3 * 60 - 45, (info["StartTime"], info["EndTime"])


def test_sigterm_during_startup_stops_cleanly_and_resumes(tmp_path, plain):
    """A SIGTERM while the ranks import and build (a short job's --signal can land there): they
    keep it, stop before the first step, and the job ends as saved-and-stopped with one line
    saying why; the resubmission trains the whole run."""
    _, _, reference = plain
    job = submit(tmp_path, "first")
    deadline = time.time() + 120
    while len(job.processes(SCRIPT, LOCAL_RANK="0")) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the ranks are past their flag parsing, still importing
    assert not job.records(), "the first step came before the signal"
    subprocess.run(["scancel", "-s", "TERM", job.id], check=True)
    info = job.wait()
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    status = job.status()
    assert status["status"] == "saved-and-stopped" and "during the start-up" in status["reason"]
    assert "nothing to save: no checkpoint yet" in status["reason"], status
    assert not job.records() and not (job.ckpt_dir / "latest_checkpointed_iteration.txt").exists()
    assert "> exiting: SIGTERM received during the start-up" in log, log[-6000:]
    _resume_equals_reference(tmp_path, job, reference, 0)


def test_a_node_lost_fails_clearly_and_resumes(tmp_path, plain):
    """SIGKILL to node2's torchrun and its rank (what a node's crash does to them): the job
    fails, says which checkpoint is kept (nothing after it is claimed), and the resubmission
    resumes from that checkpoint. (Killing torchrun alone leaves its rank running, reparented:
    the ranks may then finish the run, which is no failure.)"""
    _, _, reference = plain
    job = submit(tmp_path, "first", SAVE_INTERVAL=5)
    job.wait_iteration(7)
    node2 = job.processes("megaloop.launch", SLURMD_NODENAME="node2") + job.processes(
        SCRIPT, SLURMD_NODENAME="node2", LOCAL_RANK="0")
    assert len(node2) == 2, node2
    for pid, _ in node2:
        os.kill(pid, signal.SIGKILL)
    kept, _ = _failed_naming_the_kept_checkpoint(job)
    assert kept >= 5 and kept % 5 == 0
    _resume_equals_reference(tmp_path, job, reference, kept)
