"""Training inside a test rank the way pretrain_looplm.py trains: through the pieces of
megaloop.training.run (configure: parse, --use-checkpoint-args, validate, the resume check; start:
the CPU shim and the process groups; train: the Trainer and its exit code), so a test skips none
of them. The fork harness (tests/distributed.py) has started the process group; ``start`` reuses
it."""

import json


def build_trainer(argv, startup=None):
    """The Trainer the script builds for ``argv`` (configured and started), not yet trained."""
    from megaloop.training.run import configure, start
    from megaloop.training.trainer import Trainer

    cfg = configure(argv)
    start(cfg)
    return Trainer(cfg, startup)


def train(argv, on_trainer=None):
    """The script's sequence short of tearing the process group down: ``(exit code, trainer)``
    (trainer None when it could not be built). ``on_trainer(trainer)`` runs before training."""
    from megaloop.training.run import configure, start
    from megaloop.training.run import train as run_train

    built = []

    def keep(trainer):
        built.append(trainer)
        if on_trainer is not None:
            on_trainer(trainer)

    cfg = configure(argv)
    start(cfg)
    code = run_train(cfg, on_trainer=keep)
    return code, (built[0] if built else None)


def main_in_rank(argv) -> int:
    """pretrain_looplm.main in this rank: the whole run, exit code returned (the process group
    is destroyed at the end, as the script does)."""
    from megaloop.training import run

    return run(argv)


def records(path) -> list:
    """The JSONL records of a run's --log-jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def trained_records(rank, world, argv) -> list:
    """In a forked rank: ``argv`` (with --log-jsonl) trained start to end as the script trains
    it; rank 0 returns the run's JSONL records (the others None)."""
    code, trainer = train(argv)
    assert code == 0, code
    return records(trainer.cfg.logging.log_jsonl) if rank == 0 else None


def load_tool(name: str):
    """megaloop/cli/<name>.py (the command of tools/<name>.py) as a fresh module (its
    main(argv) callable in this process)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        f"{name}_tool", os.path.join(root, "megaloop", "cli", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool
