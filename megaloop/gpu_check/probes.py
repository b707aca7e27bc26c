"""What the GPU check's worker measures (one process, one rank; megaloop.gpu_check.worker calls
these): the environment, TE-vs-local gradients, TE-vs-local logits of a checkpoint, training
steps timed with CUDA events. Each returns plain numbers; the verdicts are
megaloop.gpu_check.rows'."""

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
            # The dot product and both norms too: the verdict sums them into one global cosine.
            per_param[k] = {"cos": cos, "rel": rel, "dot": (ga * gb).sum().item(),
                            "norm_a": na, "norm_b": nb}
        del a, b, pa, pb  # freed before world_of_one empties the GPU cache
        return {"loss_a": stats_a["loss"], "loss_b": stats_b["loss"],
                "step_losses_a": stats_a["step_losses"], "step_losses_b": stats_b["step_losses"],
                "applied": [bool(ok_a), bool(ok_b)], "init_max_diff": init,
                "params": per_param}


def generation_logits(load: str, impls: list, ids: list) -> dict:
    """The teacher-forced logits of ``ids`` from the checkpoint ``load``, built once per layer
    backend in ``impls`` as tools/generate.py --fp32 builds it (megaloop.inference.loading's
    load_for_generation: fp32 weights, eval mode), read as its engine reads them: the last loop
    step's logits over the tokenizer's vocabulary, in fp32. {"logits": one [len(ids)][vocabulary]
    list per backend}."""
    import torch

    from megaloop.device import current_device
    from megaloop.inference.loading import load_for_generation
    from megaloop.inference.precision import PrecisionConfig

    out = []
    with world_of_one():
        for impl in impls:
            # fp32 whatever the checkpoint trained in: on a GPU load_for_generation holds a
            # checkpoint trained with --bf16 (the smoke row's) in bf16 unless told otherwise
            model, tokenizer, _ = load_for_generation(load, 1, transformer_impl=impl,
                                                      purpose="teacher-forced logits",
                                                      precision=PrecisionConfig(fp32=True))
            held = sorted({str(p.dtype) for p in model.parameters()})
            if held != ["torch.float32"]:
                # The verdict's tolerance (rows.TE_LOGITS_TOL) is derived for fp32 weights and
                # activations; a 16-bit model rounds 8 times coarser and would fail it.
                raise AssertionError(f"load_for_generation held the {impl} model in {held}, "
                                     f"not fp32: the TE-vs-local logits comparison needs fp32")
            x = torch.tensor([ids], dtype=torch.long, device=current_device())
            positions = torch.arange(len(ids), device=x.device).unsqueeze(0)
            with torch.no_grad():  # no attention mask: the model's causal one, as in prefill
                logits = model(x, positions, None, num_loops=model.loop.num_loops)
            out.append(logits[0, :, :tokenizer.vocab_size].float().cpu().tolist())
            print(f"[gpu_check] {impl}: logits of {len(ids)} positions x "
                  f"{tokenizer.vocab_size} ids", flush=True)
            del model, logits  # freed before the next build and world_of_one's cache emptying
    return {"logits": out}


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


# The one layer whose first-step weight gradient the FP8 rows compare with bf16's: the core's
# first MLP output projection (the same name in the TE and the local spec; a core layer's
# gradient sums all T loop steps, so it sees FP8 in every application of the shared block).
GRAD_PROBE_PARAM = "layers.0.mlp.linear_fc2.weight"


def _probe_param(model):
    named = [(n, p) for n, p in _unwrap_names(model) if n.endswith(GRAD_PROBE_PARAM)]
    if not named:
        raise AssertionError(f"no parameter named *{GRAD_PROBE_PARAM} to compare gradients")
    return named[0]  # the prelude is empty in the FP8 rows' layout: the first is the core's


def fp8_evidence(model) -> dict:
    """What Transformer Engine's modules say about the FP8 state of their last forward: how many
    TE modules there are, how many ran under FP8 (TE sets a module's ``fp8`` from its global
    state at each forward), the recipe classes in their ``fp8_meta``, how many hold a nonzero
    amax history (delayed scaling records one per forward), and the bytes of their extra state
    (TE saves its FP8 scaling state there, empty when FP8 never ran). Without TE: {"te": False}."""
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except ImportError as exc:
        return {"te": False, "why": repr(exc)}
    mods = [m for m in model.modules() if isinstance(m, TransformerEngineBaseModule)]
    ran = [m for m in mods if getattr(m, "fp8", False)]
    amax = 0
    for m in ran:
        meta = m.fp8_meta.get("scaling_fwd")
        history = getattr(meta, "amax_history", None)
        amax += int(history is not None and bool(history.abs().max().item() > 0))
    return {"te": True, "modules": len(mods), "modules_fp8": len(ran),
            "recipes": sorted({type(m.fp8_meta.get("recipe")).__name__ for m in ran}),
            "modules_with_amax_history": amax,
            "extra_state_fp8": [_extra_state_has_fp8(m) for m in ran[:4]]}


def _extra_state_has_fp8(module) -> bool:
    """Whether a TE module's extra state (what a checkpoint keeps of it) holds FP8 state: TE
    serialises a dict (recipe, scales, amax history) after an FP8 forward and None otherwise,
    as pickled bytes in a uint8 tensor (older releases: a torch.save'd BytesIO)."""
    import io
    import pickle

    import torch

    state = module.get_extra_state()
    if isinstance(state, io.BytesIO):
        state.seek(0)
        decoded = torch.load(state, map_location="cpu", weights_only=False)
    elif isinstance(state, torch.Tensor):
        decoded = pickle.loads(state.detach().cpu().numpy().tobytes()) if state.numel() else None
    else:
        decoded = state
    return isinstance(decoded, dict) and bool(decoded)


def train_steps(argv: list, steps: int, grad_save: str | None = None,
                grad_compare: str | None = None) -> dict:
    """Build a trainer from ``argv`` and take ``steps`` training steps, each timed (forward +
    backward and optimizer separately); returns the losses, whether each step was applied, the
    times, the FLOPs and tokens of one iteration (megaloop.training.metrics'
    flops_per_iteration: layers counted per application, the trainer's own formula), the wall
    seconds of the build, the first step (compiles, TE's first FP8 casts) and the rest, and
    what TE's modules say about FP8 (``fp8_evidence``).

    ``grad_save``: write the first step's gradient of GRAD_PROBE_PARAM there (the bf16
    reference); ``grad_compare``: return that gradient's cosine against the one saved there."""
    import torch

    from megaloop.training.metrics import flops_per_iteration

    t0 = time.perf_counter()
    with world_of_one():
        cfg, trainer = build(argv)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        t_build = time.perf_counter()
        clock = StepClock(trainer)
        probe, first_grad = None, None
        if grad_save or grad_compare:
            probe = _probe_param(trainer.model)
            run = trainer._run  # the clock's wrapper: read the gradient right after step 1

            def run_and_keep(*args, **kwargs):
                nonlocal first_grad
                out = run(*args, **kwargs)
                if first_grad is None:
                    first_grad = _grad(probe[1]).float()
                return out

            trainer._run = run_and_keep
        losses, applied, grad_norms = [], [], []
        t_first = None
        for i in range(steps):
            stats, grad_norm, ok = clock.step()
            losses.append(float(stats["loss"]))
            applied.append(bool(ok))
            grad_norms.append(float(grad_norm) if grad_norm is not None else None)
            if i == 0:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t_first = time.perf_counter()
        times = clock.milliseconds()
        t_end = time.perf_counter()
        tr, loop, m = cfg.training, cfg.loop, cfg.model
        out = {"losses": losses, "applied": applied, "grad_norms": grad_norms, "ms": times,
               "flops_per_iter": flops_per_iteration(m, loop, trainer.tokenizer.vocab_size,
                                                     tr.seq_length, trainer.gbs),
               "tokens_per_iter": trainer.gbs * tr.seq_length,
               "mem_gib": torch.cuda.max_memory_allocated() / 2**30
               if torch.cuda.is_available() else None,
               "layout": f"{loop.num_core_layers(m.num_layers)} x {loop.num_loops} = depth "
                         f"{loop.effective_depth(m.num_layers)}, exit loss {loop.exit_loss}",
               "timings_s": {"build": t_build - t0, "first_step": t_first - t_build,
                             "rest": t_end - t_first},
               "fp8_evidence": fp8_evidence(trainer.model),
               "grad_param": probe[0] if probe else None}
        if grad_save:
            torch.save(first_grad, grad_save)
        if grad_compare:
            # Both on the host, as saved (.cpu() also tells the CPU shim's placement check where
            # a tensor it did not see made lives).
            ref = torch.load(grad_compare, map_location="cpu").cpu().double()
            g = first_grad.double()
            out["grad_cosine"] = float((g * ref).sum() / (g.norm() * ref.norm()).clamp_min(1e-300))
            out["grad_bitwise_equal"] = bool(torch.equal(g, ref))
        print(f"[gpu_check] timings: build {out['timings_s']['build']:.1f} s, first step "
              f"{out['timings_s']['first_step']:.1f} s, the other {steps - 1} steps "
              f"{out['timings_s']['rest']:.1f} s; FP8 evidence {out['fp8_evidence']}", flush=True)
        del clock, trainer, first_grad
        return out


def pretrain(argv: list) -> int:
    """``pretrain_looplm.py argv`` in this process (imports and compiled kernels already paid
    for); returns its exit code."""
    import pretrain_looplm

    return pretrain_looplm.main(argv)


def train_rl(argv: list) -> int:
    """``train_rl.py argv`` in this process; returns its exit code."""
    import train_rl as entry

    return entry.main(argv)
