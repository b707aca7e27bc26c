"""What the GPU check's worker measures (one process, one rank; megaloop.gpu_check.worker calls
these): the environment, TE-vs-local gradients, training steps timed with CUDA events. Each
returns plain numbers; the verdicts are megaloop.gpu_check.rows'."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(attention_shape: dict | None = None) -> dict:
    """Versions (torch, CUDA, driver, cuDNN, NCCL, Transformer Engine, megatron-core), the GPU,
    and, with a GPU and TE, one causal bf16 attention forward+backward of ``attention_shape``
    (heads, head_dim, seq, batch) through TE's DotProductAttention, so that TE's debug log
    (NVTE_DEBUG=1, NVTE_DEBUG_LEVEL=2, set before TE was imported) names the backend it picks."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda, "cuda": torch.cuda.is_available(),
            "megatron_core": _version("megatron-core"),
            "transformer_engine": _version("transformer-engine") or _version(
                "transformer_engine"), "flash_attn": _version("flash-attn"),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None,
            "nvte_env": {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}}
    if not info["cuda"]:
        return info
    if info["transformer_engine"] is None:  # installed without package metadata (some images)
        try:
            import transformer_engine

            info["transformer_engine"] = getattr(transformer_engine, "__version__", "unknown")
        except Exception as exc:
            info["transformer_engine_import_error"] = repr(exc)
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpus=torch.cuda.device_count(),
                capability=list(torch.cuda.get_device_capability(0)),
                memory_gib=round(props.total_memory / 2**30, 1))
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # a torch build without NCCL
        info["nccl"] = f"unavailable ({exc})"
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception as exc:
        info["driver"] = f"unknown (nvidia-smi: {exc})"
    if attention_shape and info["transformer_engine"]:
        try:  # a failure here is a finding, not the end of the row: the versions still count
            import transformer_engine.pytorch as te

            s = attention_shape
            attn = te.DotProductAttention(s["heads"], s["head_dim"], attn_mask_type="causal")
            q, k, v = (torch.randn(s["seq"], s["batch"], s["heads"], s["head_dim"],
                                   device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            attn(q, k, v).float().sum().backward()
            torch.cuda.synchronize()
            print("[gpu_check] attention probe done", flush=True)
        except Exception:
            import traceback

            info["attention_probe_error"] = traceback.format_exc()
            print(info["attention_probe_error"], flush=True)
    return info


# --- building a trainer in this process --------------------------------------------------------
@contextmanager
def world_of_one(seed: int = 1234):
    """megatron-core's parallel state at TP = PP = 1 for one row, torn down after it (rows in
    one worker run one after another)."""
    from megaloop import cpu_shim, runtime
    from megaloop.parallel import initialize
    from megaloop.parallel.config import ParallelConfig

    runtime.quiet_megatron()
    cpu_shim.enable()  # a no-op on a GPU machine
    initialize.initialize(ParallelConfig(), seed)
    try:
        yield
    finally:
        initialize.destroy()
        gc.collect()
        _empty_cache()


def _empty_cache():
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(argv: list):
    from megaloop.parallel.initialize import set_seed
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv)
    cfg.validate(world_size=1)
    set_seed(cfg.training.seed)  # the same RNG state before every build
    return cfg, Trainer(cfg)


def _unwrap_names(model):
    for name, p in model.named_parameters():
        while name.startswith("module."):
            name = name[len("module."):]
        yield name, p


# TE fuses the input norms into the next linear; the local spec keeps them as modules.
TE_TO_LOCAL = [(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
               (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
               (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
               (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias")]


def local_name(name: str) -> str:
    """The local spec's name of a parameter of either spec."""
    for te, local in TE_TO_LOCAL:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def _grad(p):
    g = getattr(p, "main_grad", None)
    return (g if g is not None else p.grad).detach().double().cpu()


def grads(argv_a: list, argv_b: list) -> dict:
    """Build the model twice (``argv_a``: reference, ``argv_b``: under test) from one seed, copy
    a's weights into b, take one training step each on the same batch, and return both losses
    and, per parameter, the cosine and the relative max error of b's gradient against a's."""
    import torch

    with world_of_one():
        _, a = build(argv_a)
        _, b = build(argv_b)
        pa = {local_name(n): p for n, p in _unwrap_names(a.model)}
        pb = {local_name(n): p for n, p in _unwrap_names(b.model)}
        if pa.keys() != pb.keys():
            raise AssertionError(f"parameter names differ: only in a: "
                                 f"{sorted(pa.keys() - pb.keys())}, only in b: "
                                 f"{sorted(pb.keys() - pa.keys())}")
        init = max((pa[k].detach().double().cpu() - pb[k].detach().double().cpu())
                   .abs().max().item() for k in pa)
        with torch.no_grad():
            for k in pa:
                pb[k].copy_(pa[k])
        stats_a, _, ok_a = a.train_step()
        stats_b, _, ok_b = b.train_step()
        per_param = {}
        for k in pa:
            if not pa[k].requires_grad:
                continue
            ga, gb = _grad(pa[k]), _grad(pb[k])
            na, nb = ga.norm().item(), gb.norm().item()
            cos = 1.0 if na == nb == 0 else (ga * gb).sum().item() / max(na * nb, 1e-300)
            scale = ga.abs().max().item()
            rel = 0.0 if na == nb == 0 else (ga - gb).abs().max().item() / max(scale, 1e-30)
            per_param[k] = {"cos": cos, "rel": rel}
        del a, b, pa, pb  # freed before world_of_one empties the GPU cache
        return {"loss_a": stats_a["loss"], "loss_b": stats_b["loss"],
                "step_losses_a": stats_a["step_losses"], "step_losses_b": stats_b["step_losses"],
                "applied": [bool(ok_a), bool(ok_b)], "init_max_diff": init,
                "params": per_param}


class StepClock:
    """Times the forward+backward pass (Trainer._run) and the optimizer step of each
    Trainer.train_step separately, with CUDA events on a GPU (read after one synchronize at the
    end, so timing adds no host-device sync to the steps) and the host clock on CPU. It wraps
    the trainer's own methods: the step it times is the trainer's, unchanged."""

    def __init__(self, trainer):
        import torch

        self.cuda = torch.cuda.is_available()
        self.marks = []  # per step: {"fwd_bwd": (start, end), "optim": ..., "step": ...}
        run, step = trainer._run, trainer.optimizer.step

        def timed(fn, key):
            def wrapper(*args, **kwargs):
                start = self._mark()
                out = fn(*args, **kwargs)
                self.marks[-1][key] = (start, self._mark())
                return out
            return wrapper

        trainer._run = timed(run, "fwd_bwd")
        trainer.optimizer.step = timed(step, "optim")
        self.trainer = trainer

    def _mark(self):
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def step(self):
        self.marks.append({})
        start = self._mark()
        out = self.trainer.train_step()
        self.marks[-1]["step"] = (start, self._mark())
        return out

    def milliseconds(self) -> list:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        span = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: 1e3 * (b - a))
        return [{k: span(*v) for k, v in m.items()} for m in self.marks]


def train_steps(argv: list, steps: int) -> dict:
    """Build a trainer from ``argv`` and take ``steps`` training steps, each timed (forward +
    backward and optimizer separately); returns the losses, whether each step was applied, the
    times, and the FLOPs and tokens of one iteration (megaloop.training.metrics'
    flops_per_iteration: layers counted per application, the trainer's own formula)."""
    import torch

    from megaloop.training.metrics import flops_per_iteration

    with world_of_one():
        cfg, trainer = build(argv)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        clock = StepClock(trainer)
        losses, applied, grad_norms = [], [], []
        for _ in range(steps):
            stats, grad_norm, ok = clock.step()
            losses.append(float(stats["loss"]))
            applied.append(bool(ok))
            grad_norms.append(float(grad_norm) if grad_norm is not None else None)
        times = clock.milliseconds()
        tr, loop, m = cfg.training, cfg.loop, cfg.model
        out = {"losses": losses, "applied": applied, "grad_norms": grad_norms, "ms": times,
               "flops_per_iter": flops_per_iteration(m, loop, trainer.tokenizer.vocab_size,
                                                     tr.seq_length, trainer.gbs),
               "tokens_per_iter": trainer.gbs * tr.seq_length,
               "mem_gib": torch.cuda.max_memory_allocated() / 2**30
               if torch.cuda.is_available() else None,
               "layout": f"{loop.num_core_layers(m.num_layers)} x {loop.num_loops} = depth "
                         f"{loop.effective_depth(m.num_layers)}, exit loss {loop.exit_loss}"}
        del clock, trainer
        return out


def pretrain(argv: list) -> int:
    """``pretrain_looplm.py argv`` in this process (imports and compiled kernels already paid
    for); returns its exit code."""
    import pretrain_looplm

    return pretrain_looplm.main(argv)
