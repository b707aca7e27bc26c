"""A loop step's LM loss without keeping its logits: chunked vocab-parallel head + cross-entropy.

The exit objective reads out every loop step. megatron-core's readout (``ColumnParallelLinear``
then ``vocab_parallel_cross_entropy``, what ``--loop-readout logits`` runs) leaves each step's
[s, b, V/tp] fp32 softmax (the logits, overwritten in place) in the autograd graph until the
backward: T copies of the largest activation of a dense model.

``--loop-readout chunked`` computes the same loss with ``LinearCrossEntropy``, one autograd
function over chunks of tokens. Its forward computes a chunk's logits, runs megatron-core's own
vocab-parallel cross-entropy steps on them (``VocabParallelCrossEntropy``: the max logit
all-reduced with MAX over the tensor-parallel group, then the target logit and the sum of
exponentials all-reduced with SUM, as ``vocab_parallel_cross_entropy`` does) and drops them. It
keeps its inputs (the hidden states and the weight, which the graph holds anyway) and, per token,
the max logit, the sum of exponentials and the target's position in this rank's vocabulary
slice. The backward recomputes each chunk's logits, turns them into the softmax the
cross-entropy's backward starts from, and multiplies out the gradients of the hidden states and
the weight. What a step keeps is then ~17 bytes per token instead of 4 V/tp; what it costs is one
more [tokens, h] x [h, V/tp] GEMM per step (four instead of three).

The input side is ``ColumnParallelLinear``'s: under sequence parallelism the hidden states are
all-gathered over the sequence (reduce-scattered in the backward); otherwise their gradient is
all-reduced over the tensor-parallel group, since every rank's vocabulary slice contributes to it.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.tensor_parallel.utils import VocabUtility

READOUTS = ("logits", "chunked")


def _all_reduce(tensor, op, group) -> None:
    # A size-1 group sums nothing: skip the collective's call overhead (T x chunks per step).
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token vocab-parallel CE of ``x @ weight.T`` over chunks of ``chunk`` rows, logits
    recomputed in the backward.

    x: [N, h] hidden states of all N tokens (this rank holds the whole sequence), weight:
    [V/tp, h] this rank's vocabulary rows, target: [N] global token ids. Returns the [N] fp32
    losses, replicated over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx, x, weight, target, chunk: int, group):
        n = x.size(0)
        world = group.size() if group is not None else 1
        rank = group.rank() if group is not None else 0
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            weight.size(0), rank, world)
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        logits_max = torch.empty_like(loss)
        sum_exp = torch.empty_like(loss)
        target_mask = torch.empty(n, dtype=torch.bool, device=x.device)
        masked_target = torch.empty_like(target)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            # The linear's matmul, then the cross-entropy's own steps (the logits of this chunk
            # are modified in place and dropped at the end of the iteration).
            logits, cmax = VocabParallelCrossEntropy.calculate_logits_max(
                torch.matmul(x[lo:hi], weight.t()))
            _all_reduce(cmax, torch.distributed.ReduceOp.MAX, group)
            cmask, cmasked, predicted, csum, _ = \
                VocabParallelCrossEntropy.calculate_predicted_logits(
                    logits, target[lo:hi], cmax, start, end)
            sums = torch.stack((predicted, csum))  # one collective for the two sums
            _all_reduce(sums, torch.distributed.ReduceOp.SUM, group)
            predicted, csum = sums
            loss[lo:hi] = torch.log(csum) - predicted
            logits_max[lo:hi], sum_exp[lo:hi] = cmax, csum
            target_mask[lo:hi], masked_target[lo:hi] = cmask, cmasked
        ctx.chunk = chunk
        ctx.save_for_backward(x, weight, logits_max, sum_exp, target_mask, masked_target)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        x, weight, logits_max, sum_exp, target_mask, masked_target = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_loss = grad_loss.contiguous()
        grad_x = torch.empty_like(x) if need_x else None
        # Summed over chunks in fp32 (one GEMM over all tokens accumulates in fp32 too).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        chunk = ctx.chunk
        for lo in range(0, x.size(0), chunk):
            hi = min(lo + chunk, x.size(0))
            xc = x[lo:hi]
            # softmax = exp(logits - max) / sum_exp, what the cross-entropy's forward leaves for
            # its backward.
            softmax = torch.matmul(xc, weight.t()).float()
            softmax -= logits_max[lo:hi].unsqueeze(-1)
            torch.exp(softmax, out=softmax)
            softmax.div_(sum_exp[lo:hi].unsqueeze(-1))
            grad_2d, arange_1d, update, grad_input = \
                VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
                    softmax, target_mask[lo:hi])
            grad_logits = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target[lo:hi], update, grad_input,
                grad_loss[lo:hi])
            # The logits' gradient in the linear's dtype, as the backward of `.float()` gives it.
            grad_logits = grad_logits.to(x.dtype)
            if need_x:
                torch.matmul(grad_logits, weight, out=grad_x[lo:hi])
            if need_w:
                if grad_w.dtype == x.dtype:
                    grad_w.addmm_(grad_logits.t(), xc)
                else:  # bf16/fp16: the GEMM in the linear's dtype, the sum in fp32
                    grad_w += torch.matmul(grad_logits.t(), xc).float()
        return (grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


def chunked_language_model_loss(output_layer, hidden, weight, labels, chunk: int):
    """[b, s] LM loss of ``output_layer`` (a vocab-parallel ColumnParallelLinear without bias)
    on ``hidden`` [s, b, h] (this rank's [s/tp, b, h] under sequence parallelism), equal to
    ``compute_language_model_loss(labels, output_layer(hidden, weight)[0])`` without keeping the
    logits. ``weight``: the tied embedding's weight, or None for the layer's own."""
    if output_layer.bias is not None or output_layer.gather_output:
        raise ValueError("the chunked readout needs a vocab-parallel head without bias")
    if output_layer.config.defer_embedding_wgrad_compute:
        raise ValueError("--loop-readout chunked computes the head's weight gradient itself; "
                         "it cannot be deferred (defer_embedding_wgrad_compute)")
    weight = output_layer.weight if weight is None else weight
    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        x = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                 group=group)
    elif output_layer.disable_grad_reduce:
        x = hidden
    else:
        x = copy_to_tensor_model_parallel_region(hidden, group=group)
    s, b, h = x.shape
    target = labels.transpose(0, 1).reshape(s * b)  # the row order of x.view(s * b, h)
    loss = LinearCrossEntropy.apply(x.reshape(s * b, h), weight, target, chunk, group)
    return loss.view(s, b).transpose(0, 1).contiguous()


def gather_logits(logits):
    """Vocab-parallel logits gathered over the tensor-parallel ranks (the last dimension whole).
    The group is named: without it megatron-core warns on every call, a cost per decode step."""
    from megatron.core import parallel_state, tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(
        logits, group=parallel_state.get_tensor_model_parallel_group())
