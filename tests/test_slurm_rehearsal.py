"""The SLURM example, rehearsed: examples/slurm/pretrain_looplm.sbatch runs unchanged as a job of
2 "nodes" on this machine, is preempted, resubmitted, and resumes to the loss trajectory of a
plain 2-rank run.

Only the environment is faked: SLURM_* variables of a 2-node allocation, a stub ``scontrol`` on
PATH (every host of the node list is 127.0.0.1) and a stub ``srun`` that starts the script's
command once per node, in the background, with that node's SLURM_NODEID / SLURM_PROCID (what
srun --ntasks-per-node 1 does). The script's knobs pick the CPU-sized run: 1 rank per node
(GPUS_PER_NODE), mock data, and a tiny model with gloo through EXTRA_ARGS. Each node's torchrun
joins the c10d rendezvous on 127.0.0.1:MASTER_PORT, so the job is DP=2 across the two nodes.

srun starts node 0 first (as on a cluster, only the MASTER_ADDR node can host the c10d store).
SIGTERM goes to node 1's torchrun only (node 0 never sees it): the ranks' exit check is an
all-reduce, so both finish the step, save and exit. Node 1's torchrun then exits non-zero and
srun's --kill-on-bad-exit=1 (the script's) terminates node 0's torchrun, which would otherwise
wait out torchrun's 300 s exit barrier for the agent that left. The resubmission (the same
script, a new job id) loads the checkpoint and trains to the end. The JSONL of the two jobs, joined, must
equal an uninterrupted 2-rank run of the same flags exactly (pretrain_looplm.main on two forked
gloo ranks: the jobs' torchrun launches are the ones under test, the reference needs none).
"""

import json
import os
import signal
import stat
import subprocess
import sys
import time

from distributed import console_of, free_port, run_distributed, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "examples", "slurm", "pretrain_looplm.sbatch")
TRAIN_ITERS = 20  # the signal goes at iteration 3: the stop lands well before the end

# Appended by the script after its recipe; the last value of a flag wins.
TINY = ("--num-layers 2 --num-loops 3 --hidden-size 32 --num-attention-heads 4 "
        "--ffn-hidden-size 88 --seq-length 32 --max-position-embeddings 32 --vocab-size 200 "
        "--tensor-model-parallel-size 1 --distributed-backend gloo --bf16 false "
        "--num-workers 0 --log-interval 1 --eval-interval 5 --eval-iters 1 "
        "--lr-warmup-iters 5 --hidden-dropout 0.1")

SCONTROL = """#!/bin/bash
# scontrol stand-in: `scontrol show hostnames LIST` prints one 127.0.0.1 per node.
if [[ "$1 $2" == "show hostnames" ]]; then
    for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do echo 127.0.0.1; done
    exit 0
fi
echo "scontrol stub: unsupported: $*" >&2
exit 1
"""

SRUN = """#!/bin/bash
# srun stand-in: one task per node of the fake allocation, all on this machine. Records the
# command, each node's pid (the test signals one) and log. --kill-on-bad-exit=1 as srun does it:
# the first task to exit non-zero ends the step, the others get SIGTERM, then SIGKILL after
# KillWait (slurm.conf, default 30 s; 5 s here: a torchrun blocked in its exit barrier on the
# store it hosts does not act on SIGTERM). Exits with the first failure's code.
kill_on_bad_exit=0
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in
        --kill-on-bad-exit=1|--kill-on-bad-exit|-K) kill_on_bad_exit=1; shift ;;
        *=*) shift ;;
        --ntasks-per-node|--ntasks|--nodes|-n|-N|--container-image|--container-workdir|\\
--container-mounts) shift 2 ;;
        *) shift ;;
    esac
done
printf '%s\\n' "$@" > "$SRUN_STUB_DIR/argv"
# On a cluster only the first node (MASTER_ADDR) can host torchrun's c10d store; here every
# "node" is 127.0.0.1, so node 0 starts first and the others once its store listens.
port=$(printf '%s\\n' "$@" | grep -A1 -x -- --rdzv_endpoint | tail -n 1 | sed 's/.*://')
listening() {
    awk -v p="$(printf ':%04X' "$1")" '$4 == "0A" && substr($2, length($2) - 4) == p' \\
        /proc/net/tcp /proc/net/tcp6 2>/dev/null | grep -q .
}
declare -A node_of
for ((i = 0; i < SLURM_NNODES; i++)); do
    if [[ $i -eq 1 && -n "$port" ]]; then
        for ((t = 0; t < 1200; t++)); do listening "$port" && break; sleep 0.1; done
    fi
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURMD_NODENAME=node$i \\
        "$@" > "$SRUN_STUB_DIR/node$i.log" 2>&1 &
    node_of[$!]=$i
    echo $! > "$SRUN_STUB_DIR/node$i.pid"
done
rc=0
while [[ ${#node_of[@]} -gt 0 ]]; do
    wait -n -p done_pid "${!node_of[@]}"
    status=$?
    node=${node_of[$done_pid]}
    unset "node_of[$done_pid]"
    if [[ $status -ne 0 && $rc -eq 0 ]]; then
        rc=$status
        echo "srun: error: node$node: task $node: Exited with exit code $status" >&2
        if [[ $kill_on_bad_exit -eq 1 && ${#node_of[@]} -gt 0 ]]; then
            echo "srun: Terminating the job step (--kill-on-bad-exit)" >&2
            kill -TERM "${!node_of[@]}" 2>/dev/null
            ( sleep 5; kill -KILL "${!node_of[@]}" ) > /dev/null 2>&1 &
            killer=$!
        fi
    fi
done
[[ -n "${killer:-}" ]] && kill "$killer" 2>/dev/null
exit $rc
"""


# squeue stand-in: a job with no time limit (the script then sets no --exit-duration-in-mins). The
# machine's own squeue would wait for a controller that is not running.
SQUEUE = """#!/bin/bash
echo "2026-01-01T00:00:00 Unknown"
"""


def _write_stubs(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("squeue", SQUEUE)):
        path = bindir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bindir


def _submit(tmp_path, bindir, job_id):
    """`sbatch --nodes 2` of the unchanged script, as far as the script can tell."""
    stub = tmp_path / f"srun-{job_id}"
    stub.mkdir()
    # torchrun and python are the test's interpreter's (PATH); the stubs shadow nothing else.
    path = os.pathsep.join([str(bindir), os.path.dirname(sys.executable), os.environ["PATH"]])
    env = dict(os.environ, PATH=path, SRUN_STUB_DIR=str(stub),
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="looplm-rehearsal",
               SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
               SLURM_NTASKS_PER_NODE="1", SLURM_SUBMIT_DIR=ROOT,
               MASTER_PORT=str(free_port()), GPUS_PER_NODE="1", OMP_NUM_THREADS="1",
               MOCK_DATA="true", TENSORBOARD_DIR="", TRAIN_ITERS=str(TRAIN_ITERS),
               GLOBAL_BATCH_SIZE="8", MICRO_BATCH_SIZE="2", LR="3e-3", SAVE_INTERVAL="1000",
               OUTPUT_DIR=str(tmp_path / "runs" / str(job_id)),
               CHECKPOINT_DIR=str(tmp_path / "checkpoints"), EXTRA_ARGS=TINY)
    env.pop("CONTAINER_IMAGE", None)
    proc = subprocess.Popen(["bash", SBATCH], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, stub, tmp_path / "runs" / str(job_id) / "metrics.jsonl"


def _records(log):
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _node_logs(stub):
    return "\n".join(f"--- {p.name}\n{p.read_text()}"
                     for p in sorted(stub.glob("node*.log")))


def _finish(proc, stub, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script, the srun stub and both torchruns
        out, _ = proc.communicate()
        raise AssertionError("job did not finish\n" + (out + _node_logs(stub))[-8000:])
    return out + _node_logs(stub)


def test_sbatch_two_nodes_sigterm_resubmit_equals_single_node_run(tmp_path):
    bindir = _write_stubs(tmp_path)
    ckpt = tmp_path / "checkpoints"

    # --- job 1: both nodes rendezvous, train; SIGTERM to node 1's torchrun only --------------
    proc, stub1, log1 = _submit(tmp_path, bindir, 101)
    deadline = time.time() + 240
    while (not any(r["split"] == "train" and r["iteration"] >= 3 for r in _records(log1))
           and proc.poll() is None and time.time() < deadline):
        time.sleep(0.05)
    assert proc.poll() is None, "job 1 ended before the signal\n" + _finish(proc, stub1, 10)
    os.kill(int((stub1 / "node1.pid").read_text()), signal.SIGTERM)
    out1 = _finish(proc, stub1, 180)
    assert "nodes=2 master=127.0.0.1:" in out1, out1[-6000:]
    # With --save-interval 1000, a checkpoint before the end exists only if the ranks took the
    # exit-signal path: finish the step, save (collectively, the last barrier after the tracker
    # file), exit. (Rank 0's "SIGTERM received" line may not make it to the log: srun's
    # --kill-on-bad-exit terminates the other node once the signalled torchrun exits non-zero.)
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= stopped < TRAIN_ITERS, out1[-6000:]
    assert max(r["iteration"] for r in _records(log1)) == stopped
    assert "TP 1 CP 1 PP 1 DP 2 | micro-batches per step 2" in out1, out1[-6000:]

    # --- job 2: the resubmission resumes from the checkpoint and trains to the end ------------
    proc, stub2, log2 = _submit(tmp_path, bindir, 102)
    out2 = _finish(proc, stub2, 300)
    assert proc.returncode == 0, out2[-6000:]
    assert f"loaded {ckpt}/iter_{stopped:07d}" in out2, out2[-6000:]
    assert _records(log2)[0]["iteration"] > stopped

    # --- the reference: 2 ranks on one node, uninterrupted, the flags the job ran --------------
    argv = (stub1 / "argv").read_text().splitlines()
    assert argv[1:3] == ["-m", "megaloop.launch"] and "--nnodes" in argv and "c10d" in argv, argv
    script = argv.index(os.path.join(ROOT, "pretrain_looplm.py"))
    flags = argv[script + 1:]
    ref_dir = tmp_path / "reference"
    swap = {str(ckpt): str(ref_dir / "checkpoints"),
            str(log1): str(ref_dir / "metrics.jsonl")}
    flags = [swap.get(f, f) for f in flags]
    assert flags.count(str(ref_dir / "checkpoints")) == 2  # --save and --load
    ref_dir.mkdir()
    codes = run_distributed(run_main, 2, flags, str(ref_dir), timeout=300)
    assert codes == [0, 0], "".join(console_of(ref_dir, 2))[-6000:]

    key = lambda r: (r["split"], r["iteration"], r["loss"], tuple(r["step_losses"]))  # noqa: E731
    joined = [key(r) for r in _records(log1) + _records(log2)]
    straight = [key(r) for r in _records(ref_dir / "metrics.jsonl")]
    assert [k[:2] for k in joined] == [k[:2] for k in straight]
    assert joined == straight
