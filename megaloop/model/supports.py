"""What a looped model can be asked to run, answered in one place (``LoopConfig.supports``).

Every entry point asks before it starts: the trainer's forward and evaluation for a loop count
(``depth``), decoding for an exit rule under a KV cache policy, teacher-forced scoring for an exit
rule alone, export for the Hugging Face modeling file, a layout for sequence parallelism. The
answer is None or one line naming the flag and the fix.

The rules are declared below by what they belong to: the exit gate, decoding's cache, SpiralFormer
(megaloop/model/spiral.py) and the exported modeling file (megaloop/convert/hf_modeling). Each
declaration sees the loop config and the request and returns its reason, or None; a new variant
with a limit adds one declaration to ``DECLARED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def _cli_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Request:
    """What an entry point asks of a model (None / False: not asked)."""

    depth: Optional[int] = None
    """A loop count to run (evaluation, inference, a drawn random depth)."""
    exit: Optional[object] = None
    """An early-exit rule (megaloop.model.exit_rules.ExitRule): in decoding when ``kv_policy`` is
    given, else in teacher-forced scoring."""
    kv_policy: Optional[str] = None
    """Decoding with this KV cache policy (``none``: no cache, every token recomputes the whole
    sequence)."""
    export: Optional[str] = None
    """``hf``: tools/convert_checkpoint.py export-hf."""
    model: Optional[object] = None
    """The ModelConfig, for the export's architecture rules."""
    sequence_parallel: bool = False
    """A layout with --sequence-parallel."""
    spell: Callable[[str], str] = _cli_name
    """How the caller writes a flag (``num_loops`` -> ``--num-loops`` on a command line,
    ``num_loops`` in lm-eval's --model_args)."""


def gate(loop, r: Request) -> Optional[str]:
    """The exit gate exists when the model was trained with T > 1 and an objective that reads it
    (``LoopConfig.gated``). Without it, more than one step has no exit distribution (unless the
    model was trained on the last step only), and a Q-exit has nothing to read."""
    if r.depth is not None and r.depth > 1 and not loop.gated and loop.exit_loss != "last":
        return (f"{r.spell('num_loops')} {r.depth}: this model has no exit gate (trained with "
                f"--num-loops {loop.num_loops} and --exit-loss {loop.exit_loss}), so it runs one "
                f"step only; use {r.spell('num_loops')} 1 (a model trained with --exit-loss "
                f"last runs any depth)")
    if r.exit is not None and r.exit.kind == "q" and not loop.gated:
        return (f"{r.spell('exit')} {r.exit.text}: a q-exit reads the exit gate, and this model "
                f"has none (trained with --exit-loss last or --num-loops 1); use kl:<eps>")
    return None


def decoding_cache(loop, r: Request) -> Optional[str]:
    """Early exit in decoding skips a token's remaining steps; the tokens after it read its K/V
    at those steps from the cache (filled from its exit step), so it needs one."""
    if r.exit is not None and r.kv_policy == "none":
        return (f"early exit ({r.spell('exit')}) skips the remaining steps of a token, which "
                f"needs a KV cache: use {r.spell('kv_policy')} full (or another cache policy)")
    return None


def exit_depth(loop, r: Request) -> Optional[str]:
    """``fixed:n`` stops every token after step n; past the steps that run it would silently
    mean full depth."""
    if r.exit is None or r.exit.kind != "fixed":
        return None
    depth = r.depth if r.depth is not None else loop.num_loops
    if r.exit.value > depth:
        return (f"{r.spell('exit')} {r.exit.text}: this model runs {depth} loop step"
                f"{'s' if depth > 1 else ''} ({r.spell('num_loops')} {depth}), so no token can "
                f"leave after step {r.exit.text.partition(':')[2]}; use fixed:1 to fixed:{depth}, "
                f"or none for full depth")
    return None


def spiral(loop, r: Request) -> Optional[str]:
    """SpiralFormer (--loop-resolutions / --loop-topology) fixes one operator per loop step, and
    its cached decoding keeps each coarse step's chunk latents for the whole batch."""
    from megaloop.model.spiral_schedule import chunk_sizes, is_active

    if not is_active(loop):
        return None
    sizes = chunk_sizes(loop)
    if r.depth is not None and r.depth != len(sizes):
        return (f"{r.spell('num_loops')} {r.depth}: this model has a per-step schedule of "
                f"{len(sizes)} loop steps (--loop-resolutions / --loop-topology); it cannot run "
                f"{r.depth} loops; use {r.spell('num_loops')} {len(sizes)}")
    if r.exit is not None and r.kv_policy is not None:
        return (f"{r.spell('exit')} {r.exit.text}: SpiralFormer's cached decoding keeps its chunk "
                f"latents (--loop-resolutions / --loop-topology) for the whole batch, so a row "
                f"cannot leave it at an early step; decode without {r.spell('exit')} (scoring "
                f"under an exit rule works)")
    if r.export:
        return ("export-hf does not implement SpiralFormer multi-resolution steps or the Anchor / "
                f"MeSH topologies; this checkpoint has --loop-resolutions "
                f"{loop.loop_resolutions!r} --loop-topology {loop.loop_topology}")
    if r.sequence_parallel and any(g > 1 for g in sizes):
        return ("--sequence-parallel splits the token sequence over TP ranks, which coarse "
                "--loop-resolutions steps would have to gather back; drop --sequence-parallel "
                "(TP without SP works)")
    return None


# What the exported modeling file (megaloop/convert/hf_modeling/modeling_megaloop.py)
# implements: flag -> (config field, the values it implements).
EXPORT_MODEL = {
    "--position-embedding-type": ("position_embedding_type", ("rope",)),
    "--normalization": ("normalization", ("RMSNorm",)),
    "--squared-relu": ("squared_relu", (False,)),
    "--swiglu": ("swiglu", (True,)),
    "--disable-bias-linear": ("disable_bias_linear", (True,)),
    "--rotary-percent": ("rotary_percent", (1.0,)),
    # Huginn's pieces: a Huginn-style model exports under Huginn's names (--names huginn).
    "--qk-bias": ("qk_bias", (False,)),
    "--rotary-interleaved": ("rotary_interleaved", (False,)),
    "--embedding-scale": ("embedding_scale", (1.0,)),
    # Parcae's pieces: a Parcae-style model exports under Parcae's names (--names parcae).
    "--value-embeddings": ("value_embeddings", (False,)),
    "--qk-layernorm-scale-free": ("qk_layernorm_scale_free", (False,)),
}
EXPORT_LOOP = {
    "--step-norm": ("step_norm", ("rms",)),
    "--input-injection": ("input_injection", ("none", "scalar-mix")),
    "--history-injection": ("history_injection", ("none",)),
    "--timestep-conditioning": ("timestep_conditioning", ("none",)),
    "--state-init": ("state_init", ("prelude",)),
    "--share-final-norm": ("share_final_norm", (False,)),
    # Parcae's pieces ("Parcae", arXiv 2604.12946): not in the modeling file.
    "--injection-source-norm": ("injection_source_norm", (False,)),
    "--readout-projection": ("readout_projection", (False,)),
}


def export(loop, r: Request) -> Optional[str]:
    """export-hf writes what the modeling file implements, nothing else."""
    if not r.export:
        return None
    if r.model is not None:
        for flag, (name, supported) in EXPORT_MODEL.items():
            value = getattr(r.model, name)
            if value not in supported:
                return (f"export-hf supports {flag} {' or '.join(map(str, supported))} only; "
                        f"this checkpoint has {flag} {value}")
        if r.model.norm_scheme not in ("ouro", "pre"):
            return f"export-hf supports --norm-scheme ouro and pre, not {r.model.norm_scheme}"
    for flag, (name, supported) in EXPORT_LOOP.items():
        value = getattr(loop, name)
        if value not in supported:
            return (f"export-hf supports {flag} {' or '.join(map(str, supported))} only; this "
                    f"checkpoint has {flag} {value}")
    return None


DECLARED = (gate, exit_depth, decoding_cache, export, spiral)


def supports(loop, request: Request) -> Optional[str]:
    """The first declared reason ``loop`` cannot do ``request``, or None."""
    if request.export not in (None, "hf"):
        raise ValueError(f"unknown export {request.export!r} (export-hf writes 'hf')")
    for declared in DECLARED:
        reason = declared(loop, request)
        if reason:
            return reason
    return None
