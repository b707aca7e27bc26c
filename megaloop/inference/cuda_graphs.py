"""Decode forwards with static shapes, replayed as CUDA graphs on a GPU (``--cuda-graphs``).

At small batch a GPU decodes as fast as the host can launch kernels: a decode step of a looped
model is some hundred kernels per loop step, each launched from Python. A CUDA graph records
the kernels of one forward once and replays them with one launch; it needs every tensor of the
forward to keep its shape and address from one replay to the next.

The engine's decode forwards over the same rows reuse one gathered view of the cache for up to
``SPARE_COLUMNS`` steps (megaloop/inference/engine.py), so within a view only the inputs change:
the fed ids, their positions, the column the new K/V go to and the mask. ``--cuda-graphs`` makes
those forwards static (megaloop's layer forward, ``STATIC``): the new K/V are written at a
column held in a device tensor, and attention reads the view's whole width under a mask that
hides the columns after the new token, instead of the prefix that grows by one per step. Then
``DecodeGraphs`` captures a view's forward at its second step (the first warms up the caching
allocator) and replays it, its inputs copied into the captured buffers, until the view is
gathered afresh. On a CPU there is nothing to capture: the flag runs the same static forwards
eagerly (their tokens and the shapes they keep are what the CPU tests check), and the server
says so in its start line.

Only what keeps a forward's work the same from step to step is graphed: no exit rule (rows
leave the loop at data-dependent steps), no speculation, the ``full`` KV policy, one
tensor-parallel rank (NCCL inside a captured graph is left for a GPU run to settle), megaloop's
layer forward; the engine refuses other combinations by flag.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def check_cuda_graphs(on: bool, exit_rule, speculate, kv_policy: str, tp_size: int,
                      layer_forward: bool, random_state: bool = False) -> None:
    """ValueError naming --cuda-graphs where the decode forwards cannot be static.
    ``random_state``: the model starts its loop from noise drawn per forward (--state-init
    noise), which a replayed graph would repeat."""
    if not on:
        return
    reasons = [(random_state, "a model whose loop starts from noise drawn afresh per forward "
                              "(--state-init noise; a replay would repeat one draw)"),
               (exit_rule is not None, "--exit (rows leave the loop at data-dependent steps)"),
               (bool(speculate), "--speculate (drafts and verify vary per round)"),
               (kv_policy != "full", f"--kv-policy {kv_policy} (only full keeps one cache "
                                     f"per step)"),
               (tp_size > 1, "tensor parallelism (collectives inside a graph: not done)"),
               (not layer_forward, "megatron-core's layer forward (--layer-forward auto on a "
                                   "model megaloop's forward computes)")]
    for bad, what in reasons:
        if bad:
            raise ValueError(f"--cuda-graphs with {what}: leave one of them out")


class DecodeGraphs:
    """One captured decode forward per gathered view (on a GPU), replayed until the view is
    dropped. ``run(view, inputs, forward)``: ``forward(**inputs)``'s output, from a replay where
    one was captured for ``view`` (its inputs copied in first), else eagerly."""

    def __init__(self):
        self.capture = torch.cuda.is_available()
        self._view = None  # the view the graph below belongs to
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: dict = {}
        self._output = None
        self._seen = 0  # eager forwards run on this view so far
        self.stats = {"captures": 0, "replays": 0}

    def run(self, view, inputs: dict, forward: Callable):
        if view is not self._view:  # a fresh gather: the old graph read the old buffers
            self._view, self._graph, self._seen = view, None, 0
        if not self.capture:
            return forward(**inputs)
        if self._graph is None and self._seen < 1:
            self._seen += 1
            return forward(**inputs)  # warm-up: the allocator's blocks exist before capture
        if self._graph is None:
            self._inputs = {k: v.clone() for k, v in inputs.items()}
            self._graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(self._graph, stream=stream):
                self._output = forward(**self._inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.stats["captures"] += 1
        for k, v in inputs.items():
            self._inputs[k].copy_(v, non_blocking=True)
        self._graph.replay()
        self.stats["replays"] += 1
        return self._output.clone()
