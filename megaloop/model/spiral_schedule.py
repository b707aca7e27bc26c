"""The SpiralFormer schedule and topology flags as numbers: the chunk size g_t of each loop
step, its offset and shift, and the checks of the flags' own values. Pure Python (no torch): flag
validation reads it before torch and megatron-core load; megaloop/model/spiral.py builds the
operators on it.
"""

from __future__ import annotations

from fractions import Fraction
from typing import List


def parse_resolutions(text: str, num_loops: int) -> List[int]:
    """``--loop-resolutions`` -> chunk sizes g_t (1 = full resolution), one per loop step.

    Empty: none (the plain loop). ``coarse-to-fine``: r_t = 2 r_{t-1} ending at 1 over
    --num-loops steps (T=4: 1/8,1/4,1/2,1). Otherwise a comma list of fractions 1/g."""
    text = (text or "").strip()
    if not text:
        return []
    if text == "coarse-to-fine":
        return [2 ** (num_loops - 1 - t) for t in range(num_loops)]
    sizes = []
    for part in text.split(","):
        try:
            r = Fraction(part.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--loop-resolutions: cannot read {part.strip()!r}; write fractions "
                             f"such as 1/8,1/4,1/2,1") from None
        if r <= 0 or r > 1 or r.numerator != 1:
            raise ValueError(f"--loop-resolutions: {part.strip()} is not of the form 1/g with an "
                             f"integer chunk size g >= 1; write e.g. 1/8,1/4,1/2,1")
        sizes.append(r.denominator)
    return sizes


def chunk_sizes(loop) -> List[int]:
    """g_t for every step of a LoopConfig (all 1 without a schedule)."""
    return parse_resolutions(loop.loop_resolutions, loop.num_loops) or [1] * loop.num_loops


def offset(g: int, kind: str) -> int:
    """omega_t: ``half`` floor(g/2) (SpiralFormer's default) or ``zero``."""
    return g // 2 if kind == "half" else 0


def shift(g: int, kind: str) -> int:
    """s_t: ``overlap`` g - 1 (SpiralFormer's default) or ``parallel`` g; 0 at full resolution."""
    if g == 1:
        return 0
    return g - 1 if kind == "overlap" else g


def is_active(loop) -> bool:
    """Whether a model needs the spiral machinery (any schedule or a topology)."""
    return bool((loop.loop_resolutions or "").strip()) or loop.loop_topology != "plain"


def validate_loop(loop) -> None:
    """Checks of the spiral flags' own values (rules between features live in
    ``RunConfig.validate``); ValueError names the flag and the fix."""
    sizes = parse_resolutions(loop.loop_resolutions, loop.num_loops)
    if sizes and len(sizes) != loop.num_loops:
        raise ValueError(f"--loop-resolutions gives {len(sizes)} resolutions but --num-loops is "
                         f"{loop.num_loops}: give one per loop step, or `coarse-to-fine`")
    if loop.mesh_slots < 0 or (loop.loop_topology == "mesh" and loop.mesh_slots == 1):
        raise ValueError(f"--mesh-slots {loop.mesh_slots}: use 0 (T + 3) or at least 2")
