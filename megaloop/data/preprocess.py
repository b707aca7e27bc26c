"""JSONL -> Megatron indexed datasets (the engine behind tools/preprocess_data.py).

Nothing on this path imports torch or megatron-core (numpy, the tokenizer library and tqdm
only), so a run starts in a fraction of a second; the ``.bin/.idx`` files are written by
megaloop.data.indexed_format, byte for byte what megatron-core's ``IndexedDatasetBuilder``
writes.

Layout of the work: a plain JSONL file is cut into contiguous byte ranges (8 per worker), and
each worker process takes the next free range, reads it itself (a line belongs to the range
holding its first byte), parses and batch-encodes it in batches of about ``batch_bytes`` of
input, and writes the tokens to that range's part file. The main process only waits, shows
progress and, at the end, joins the parts in range order and writes the index. So the output is
the documents in input order, whatever the number of workers or the batch size, and nothing is
sent between processes per document. A gzip-compressed input cannot be split by bytes: one worker
reads it and encodes each batch on ``workers`` threads (sentencepiece's multi-threaded batch
encoder).

Memory per worker is bounded by one batch: about ``batch_bytes`` of input plus the longest line,
with its tokens, whatever the size of the corpus (a very long document is a batch of its own).

Every output goes to a temporary name (``*.bin.tmp<pid>_<host>``, parts
``*.bin.tmp<pid>_<host>.<k>``) renamed only when the whole input succeeded. On any failure,
Ctrl-C included, the main process kills its workers (they ignore SIGINT and never hold anything
the main process waits on) and removes every temporary file before the exception propagates, so
an interrupt ends the run at once and leaves nothing behind. SIGTERM (what SLURM, ``timeout``
and ``kill`` send) is treated the same way: it raises ``Terminated``, a KeyboardInterrupt, in
the main process; its default action would end the main process alone, orphaning the workers
and leaving every temporary file. With ``workers=0`` everything runs in the calling process
(debugging): there an interrupt waits for the batch being encoded.

SIGKILL (the OOM killer, ``timeout -s KILL``, SLURM's last word) leaves no clean-up to run. The
workers die with the main process: the kernel kills each when its parent dies (Linux's
parent-death signal), a thread in each ends it when its parent pid changes (where there is no
such signal), and a worker holds no read end of any pipe, so one still running fails on its
next message instead of blocking on a pipe nobody reads. The temporary names carry their run's
pid and host, so the next run into the same output prefix removes those of a run on this host
whose pid has ended, and leaves those of a live run, or of another host sharing the
filesystem, alone.

One run per output prefix: two runs into one prefix would each publish and the later would
silently replace the other's files, so a run holds ``<prefix>.preprocess.lock``
(megaloop.lockfile, as --save's lock) from before it writes anything until it has published or
cleaned up, Ctrl-C and SIGTERM included. A second run is refused (``OutputInUse``), naming
the holder; the lock of a run that was killed is taken over with a note: at once on this host
(its pid has ended), after ``LOCK_STALE_MIN`` minutes without a refresh from another host (a
running holder touches it every ``LOCK_REFRESH_S`` seconds).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Iterator, Optional

import numpy

from megaloop import lockfile
from megaloop.data.batch_encoder import SFT_KEYS, BatchEncoder
from megaloop.data.config import TokenizerConfig
from megaloop.data.indexed_format import optimal_dtype, write_digest, write_index
from megaloop.data.jsonl import (DEFAULT_BATCH_BYTES, BadInputError, byte_ranges, line_number,
                                 read_batches)
from megaloop.data.tokenizers import build_tokenizer

RANGES_PER_WORKER = 8
LOCK_SUFFIX = ".preprocess.lock"
LOCK_REFRESH_S = 60.0
LOCK_STALE_MIN = 10.0  # ten refreshes missed: the holder is gone (another host's lock)


@dataclass
class PreprocessStats:
    documents_read: int = 0
    bad_lines: int = 0
    documents: dict[str, int] = field(default_factory=dict)  # written, per key
    empty: dict[str, int] = field(default_factory=dict)  # skipped because empty, per key
    tokens: dict[str, int] = field(default_factory=dict)  # per key (EODs included)
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)  # dataset prefixes written

    def summary(self) -> str:
        lines = [f"documents read: {self.documents_read}   bad lines skipped: {self.bad_lines}"]
        for key in self.documents:
            lines.append(f"[{key}] documents: {self.documents[key]}   tokens: {self.tokens[key]}"
                         f"   empty skipped: {self.empty[key]}")
        total = next(iter(self.tokens.values()), 0)  # first key's tokens (sft: the text)
        secs = max(self.seconds, 1e-9)
        lines.append(f"time: {self.seconds:.2f} s   {self.documents_read / secs:,.0f} docs/s   "
                     f"{total / secs:,.0f} tokens/s")
        return "\n".join(lines)


# -- workers: byte ranges into part files ----------------------------------------------------

@dataclass
class Job:
    """What every worker knows: the input, its byte ranges, where range i's tokens go."""

    path: str
    ranges: list[tuple[int, Optional[int]]]  # end None: to the end of the stream (gzip)
    part_prefixes: dict[str, str]  # key -> prefix of the part files, one per range
    tok_cfg: TokenizerConfig
    data_format: str
    json_keys: list[str]
    append_eod: bool
    skip_bad_lines: bool
    batch_bytes: int
    threads: int = 1

    def part(self, key: str, i: int) -> str:
        return f"{self.part_prefixes[key]}.{i}"


class RangeQueue:
    """Hands out range indices in input order to whichever worker is free (ranges differ in
    encoding cost, so static halves would leave one worker idle at the end). After a bad line in
    range r no later range starts: every earlier one has started and will report first."""

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("fork")
        self._lock = ctx.Lock()
        self._next = ctx.RawValue("q", 0)
        self._stop = ctx.RawValue("q", n)

    def take(self) -> Optional[int]:
        with self._lock:
            i = self._next.value
            if i >= self._stop.value:
                return None
            self._next.value = i + 1
            return i

    def stop_after(self, i: int) -> None:
        with self._lock:
            self._stop.value = min(self._stop.value, i + 1)


def encode_ranges(job: Job, queue: RangeQueue, emit: Callable[[tuple], None]) -> None:
    """Encode ranges taken from ``queue`` into their part files. Emits ``("progress", bytes,
    documents, {key: tokens}, bad, {key: empty})`` per batch, ``("done", i, {key: lengths})`` per
    range, or ``("bad", i, offset, reason)`` on a bad line (when not skipping), and stops."""
    encoder = BatchEncoder(build_tokenizer(job.tok_cfg), job.data_format, job.json_keys,
                           job.append_eod, job.threads)
    while (i := queue.take()) is not None:
        start, end = job.ranges[i]
        files = {key: open(job.part(key, i), "wb") for key in job.part_prefixes}
        lengths: dict[str, list[numpy.ndarray]] = {key: [] for key in files}
        try:
            for offsets, lines in read_batches(job.path, start, end, job.batch_bytes):
                result = encoder(offsets, lines)
                if result.bad and not job.skip_bad_lines:
                    queue.stop_after(i)
                    emit(("bad", i) + result.bad[0])
                    return
                for key, (values, lens) in result.arrays.items():
                    files[key].write(values.tobytes())
                    lengths[key].append(lens.astype(numpy.int32))
                emit(("progress", sum(map(len, lines)), result.documents_read,
                      {k: len(v) for k, (v, _) in result.arrays.items()}, len(result.bad),
                      result.empty))
        finally:
            for f in files.values():
                f.close()
        emit(("done", i, {k: numpy.concatenate(v) if v else numpy.zeros(0, numpy.int32)
                          for k, v in lengths.items()}))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that the same
    clean-up runs (``except KeyboardInterrupt`` catches both)."""


def raise_terminated(signum, frame):
    raise Terminated()


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 0.5


def _die_with_parent(parent: int) -> None:
    """End this worker when its parent dies, whatever kills the parent (SIGKILL runs no
    clean-up). Workers ignore SIGINT and SIGTERM, so without this they outlive the run.

    Linux's parent-death signal fires when the parent *thread* that forked this process ends,
    not the parent process: workers are forked by the thread that runs ``preprocess``, which
    waits for them (or kills them) before it returns, so it outlives them. The thread below
    covers systems without prctl; it needs the GIL, so it may wait for a batch being encoded.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: not Linux
        pass
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)

    def watch() -> None:
        # Compared with the parent's pid, not 1: an orphan goes to the nearest subreaper.
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker(conn, job: Job, queue: RangeQueue, parent: int, inherited: list) -> None:
    _die_with_parent(parent)
    # The fork copied the read ends of this worker's pipe and of its elder siblings'. Held
    # here, they keep a pipe "read" after the main process is gone, so a worker that outlived
    # it blocked forever on a full pipe; closed, its next message fails (EPIPE) and it ends.
    for end in inherited:
        end.close()
    # Ctrl-C reaches the whole process group, SLURM's SIGTERM every process of the job: the
    # main process alone decides (it kills us).
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)
    try:
        encode_ranges(job, queue, conn.send)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class _Workers:
    """Worker processes sharing one job and range queue, and their pipes; ``kill`` ends them
    at once."""

    def __init__(self):
        self.procs, self.conns = [], []

    def start(self, job: Job, queue: RangeQueue, workers: int) -> None:
        ctx = multiprocessing.get_context("fork")
        # A KeyboardInterrupt inside Process.start() would leave a forked worker this object
        # does not know (so cannot kill): interrupts wait until every worker is recorded.
        with _interrupts_deferred(drop=False):
            for _ in range(workers):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, daemon=True,
                                   args=(send, job, queue, os.getpid(), self.conns + [recv]))
                proc.start()
                send.close()
                self.procs.append(proc)
                self.conns.append(recv)

    def messages(self) -> Iterator[tuple[int, tuple]]:
        """(worker index, message) until every worker has finished."""
        open_conns = dict(zip(self.conns, range(len(self.conns))))
        while open_conns:
            for conn in wait(list(open_conns), timeout=0.2):
                try:
                    msg = conn.recv()
                except EOFError:
                    k = open_conns.pop(conn)
                    self.procs[k].join()
                    if self.procs[k].exitcode != 0:
                        raise RuntimeError(f"preprocessing worker {k} died (exit code "
                                           f"{self.procs[k].exitcode})") from None
                    continue
                yield open_conns[conn], msg

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()


# -- main side -------------------------------------------------------------------------------

def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


class _Progress:
    def __init__(self, stats: PreprocessStats, total_bytes: Optional[int], show: bool,
                 log_interval: int, first_key: str):
        from tqdm import tqdm

        self.stats, self.first_key = stats, first_key
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show,
                        smoothing=0.1, dynamic_ncols=True)
        self.log_interval, self.next_log = log_interval, log_interval
        self.start = time.perf_counter()

    def update(self, msg: tuple) -> None:
        _, nbytes, docs, tokens, bad, empty = msg
        st = self.stats
        st.documents_read += docs
        st.bad_lines += bad
        for key in tokens:
            st.tokens[key] += tokens[key]
            st.empty[key] += empty[key]
        self.bar.update(nbytes)
        if st.documents_read >= self.next_log:
            self.next_log = st.documents_read + self.log_interval
            rate = st.tokens[self.first_key] / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{st.documents_read:,} docs {rate:,.0f} tok/s",
                                     refresh=False)


@contextlib.contextmanager
def _interrupts_deferred(drop: bool):
    """A Ctrl-C or SIGTERM inside the block is recorded and, when the block ends, raised (or
    dropped).

    A handler that records, not a signal mask: a SIGINT that arrived just before the block
    still runs its Python handler at the next bytecode, inside the block, which a mask cannot
    stop (found by tests/test_data_preprocess_workers.py: a KeyboardInterrupt inside
    Process.start() left an unkillable worker writing parts after the clean-up).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    caught = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in INTERRUPTS}
    try:
        yield
    finally:
        for s in INTERRUPTS:
            signal.signal(s, previous[s])
        if caught and not drop and callable(previous[caught[0]]):
            # default_int_handler / raise_terminated: raises KeyboardInterrupt / Terminated
            previous[caught[0]](caught[0], None)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises Terminated inside the block (main thread; a caller's own handler is
    kept), so a terminated run cleans up as an interrupted one does."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def temporary_suffix() -> str:
    """What this run appends to the names of its temporary files: its pid and host, so that a
    later run can tell a killed run's files from those of a run still going."""
    return f".tmp{os.getpid()}_{socket.gethostname()}"


def remove_stale_temporaries(prefixes: list[str]) -> dict[int, list[str]]:
    """Remove the temporary files of ``prefixes``' datasets (``<prefix>.bin.tmp<pid>_<host>``,
    its parts ``.<k>``, and the ``.idx``'s) left by ended runs on this host: a killed run
    cleans nothing up. Returns {pid: the names of its files removed}."""
    host = socket.gethostname()
    removed: dict[int, list[str]] = {}
    for prefix in prefixes:
        folder = os.path.dirname(os.path.abspath(prefix))
        pattern = re.compile(re.escape(os.path.basename(prefix)) + r"\.(?:bin|idx)\.tmp(\d+)_"
                             + re.escape(host) + r"(?:\.\d+)?")
        for name in sorted(os.listdir(folder)):
            match = pattern.fullmatch(name)
            if match and not lockfile.pid_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):  # another run removed it first
                    os.remove(os.path.join(folder, name))
                    removed.setdefault(int(match.group(1)), []).append(name)
    return removed


class OutputInUse(Exception):
    """Another live preprocessing run holds the output prefix's lock."""


@contextlib.contextmanager
def output_lock(output_prefix: str):
    """Hold ``<output_prefix>.preprocess.lock`` inside the block (refreshed every
    ``LOCK_REFRESH_S`` by a thread, so another host can tell a live holder from a dead one);
    released however the block ends. Raises OutputInUse when a live run holds it, ValueError
    when it cannot be created. Notes on stale locks taken over go to stderr."""
    path = output_prefix + LOCK_SUFFIX
    got, stop = None, threading.Event()
    try:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
            # An interrupt between creating the file and filling it would leave a lock naming
            # nobody, refused as "unknown" for LOCK_STALE_MIN: it waits for the taking to end.
            with _interrupts_deferred(drop=False):
                got = lockfile.take(path, LOCK_STALE_MIN,
                                    f"the {LOCK_STALE_MIN:g} min within which a running "
                                    f"preprocessing refreshes it")
        except OSError as exc:
            raise ValueError(f"--output-prefix {output_prefix}: cannot create the lock file "
                             f"{path} ({exc.strerror}); check that its folder is "
                             f"writable") from None
        for note in got.notes:
            print(note, file=sys.stderr)
        if got.token is None:
            holder = "other runs keep taking it" if got.raced else lockfile.describe(got.holder)
            raise OutputInUse(f"--output-prefix {output_prefix} is in use by another "
                              f"preprocessing run: {holder} (lock file {path}). Wait for it to "
                              f"finish, choose another --output-prefix, or delete the lock file "
                              f"if that run is gone")

        def refresh() -> None:
            while not stop.wait(LOCK_REFRESH_S):
                with contextlib.suppress(OSError):  # removed by hand: nothing to refresh
                    os.utime(path)

        # Workers are forked while this thread runs: it holds no lock they could inherit.
        threading.Thread(target=refresh, name="preprocess-lock", daemon=True).start()
        yield
    finally:
        # A Ctrl-C landing in the release (after publishing, say) must not leave the lock.
        with _interrupts_deferred(drop=False):
            stop.set()
            if got is not None and got.token is not None:
                lockfile.release(path, got.token)


def _join_parts(target: str, parts: list[str]) -> None:
    """``target`` = the parts back to back; the first part is renamed, not copied."""
    os.replace(parts[0], target)
    with open(target, "ab") as out:
        for part in parts[1:]:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            os.remove(part)


def preprocess(input_path: str, output_prefix: str, tok_cfg: TokenizerConfig,
               json_keys: tuple[str, ...] = ("text",), data_format: str = "pretrain",
               workers: int = 1, append_eod: bool = False, skip_bad_lines: bool = False,
               batch_bytes: int = DEFAULT_BATCH_BYTES, log_interval: int = 1000,
               progress: bool = True) -> PreprocessStats:
    """Tokenize ``input_path`` (JSONL or JSONL.gz) into ``<output_prefix>_<key>_document``.

    Raises BadInputError on the first bad line unless ``skip_bad_lines``, and when no document
    is left to write (an empty input, or every line blank, bad or empty); OutputInUse when
    another run writes ``output_prefix``; KeyboardInterrupt (Terminated for SIGTERM) after
    removing every temporary file.
    """
    # The lock before anything in the output folder is touched, released however this ends.
    with _sigterm_raises(), output_lock(output_prefix):
        return _preprocess(input_path, output_prefix, tok_cfg, json_keys, data_format, workers,
                           append_eod, skip_bad_lines, batch_bytes, log_interval, progress)


def _preprocess(input_path, output_prefix, tok_cfg, json_keys, data_format, workers,
                append_eod, skip_bad_lines, batch_bytes, log_interval, progress):
    tokenizer = build_tokenizer(tok_cfg)  # in this process too: a bad model fails here, once
    keys = SFT_KEYS if data_format == "sft" else tuple(json_keys)
    dtypes = {k: numpy.uint8 if k == "lossmask" else optimal_dtype(tokenizer.vocab_size)
              for k in keys}
    finals = {k: output_prefix_for(output_prefix, k) for k in keys}
    tmp = temporary_suffix()
    gz = input_path.endswith(".gz")
    if gz or workers == 0:
        ranges, threads = [(0, None)], max(workers, 1)
    else:  # several ranges per worker: a free worker takes the next (RangeQueue)
        ranges, threads = byte_ranges(os.path.getsize(input_path), RANGES_PER_WORKER * workers), 1
    job = Job(input_path, ranges, {k: f"{finals[k]}.bin{tmp}" for k in keys}, tok_cfg,
              data_format, list(json_keys), append_eod, skip_bad_lines, batch_bytes, threads)
    queue = RangeQueue(len(ranges))
    temporaries = [job.part(k, i) for k in keys for i in range(len(ranges))]
    temporaries += [finals[k] + ext + tmp for k in keys for ext in (".bin", ".idx")]
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    for pid, names in remove_stale_temporaries(list(finals.values())).items():
        print(f"removed {len(names)} temporary file(s) of run {pid} on this host, which ended "
              f"without cleaning up (killed?): {', '.join(names)}", file=sys.stderr)

    stats = PreprocessStats(documents={k: 0 for k in keys}, empty={k: 0 for k in keys},
                            tokens={k: 0 for k in keys})
    bar = _Progress(stats, None if gz else os.path.getsize(input_path), progress, log_interval,
                    keys[0])
    pool = None
    lengths: list[Optional[dict]] = [None] * len(ranges)  # per range: key -> lengths
    first_bad: Optional[tuple[int, int, str]] = None  # (range, offset, reason)
    digests: dict[str, str] = {}  # key -> SHA-1 of its .idx

    def handle(k: int, msg: tuple) -> None:
        nonlocal first_bad
        if msg[0] == "progress":
            bar.update(msg)
        elif msg[0] == "done":
            lengths[msg[1]] = msg[2]
        elif msg[0] == "bad":
            if first_bad is None or msg[1] < first_bad[0]:
                first_bad = msg[1:]
        else:
            raise RuntimeError(f"preprocessing worker {k} failed:\n{msg[1]}")

    try:
        if workers == 0:
            encode_ranges(job, queue, lambda msg: handle(0, msg))
        else:
            pool = _Workers()  # assigned first: an interrupt inside start() still kills
            pool.start(job, queue, workers)
            for k, msg in pool.messages():
                handle(k, msg)
        if first_bad is not None:
            _, offset, reason = first_bad
            raise BadInputError(f"{input_path}:{line_number(input_path, offset)}: {reason} "
                                "(pass --skip-bad-lines to skip such lines)")
        lost = [i for i, d in enumerate(lengths) if d is None]
        if lost:
            raise RuntimeError(f"preprocessing lost byte ranges {lost} of the input (a worker "
                               "ended early)")
        for key in keys:
            per_key = [d[key] for d in lengths]
            stats.documents[key] = sum(map(len, per_key))
            if stats.documents[key] == 0:
                raise BadInputError(
                    f"{input_path}: no documents to write for key {key!r} "
                    f"({stats.documents_read} non-blank lines read, {stats.bad_lines} bad lines "
                    f"skipped, {stats.empty[key]} empty after tokenization); an empty dataset "
                    "cannot be opened: check the file and --json-keys")
            _join_parts(finals[key] + ".bin" + tmp, [job.part(key, i) for i in range(len(ranges))])
            digests[key] = write_index(finals[key] + ".idx" + tmp, dtypes[key],
                                       numpy.concatenate(per_key))
        bar.bar.close()
        stats.seconds = time.perf_counter() - bar.start
        stats.outputs = [finals[k] for k in keys]
        # Publish: .bin before .idx, so a reader that sees the new .idx sees the new .bin. A
        # Ctrl-C during the renames (microseconds) comes too late and is dropped: half a
        # dataset must never be visible.
        with _interrupts_deferred(drop=True):
            for key in keys:
                for ext in (".bin", ".idx"):
                    os.replace(finals[key] + ext + tmp, finals[key] + ext)
        for key in keys:  # after the renames: a digest describes the published .idx
            write_digest(finals[key], digests[key])
        return stats
    except BaseException:
        # A (second) Ctrl-C must not cut the clean-up short: it is delivered after it.
        with _interrupts_deferred(drop=False):
            if pool is not None:
                pool.kill()
            for path in temporaries:
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        bar.bar.close()
