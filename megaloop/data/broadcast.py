"""Micro-batches for the ranks that use them: read once per tensor-parallel group, broadcast.

As Megatron-LM's ``get_batch`` (``get_batch_on_this_tp_rank``): only the first and the last
pipeline stage use a batch (the embedding needs tokens and positions, the head labels and the loss
mask), and within such a stage only tensor-parallel rank 0 builds the datasets, samples and
collates (with its DataLoader workers); it broadcasts each tensor to the other ranks of its
tensor-parallel group. So the data work and the DataLoader processes do not grow with TP.

- A middle pipeline stage uses only the batch's shape (rotary table, carry layout) and gets
  *placeholders*: tensors on the ``meta`` device with the right shapes and no data, so that any use
  of their values fails loudly instead of computing on made-up tokens. With
  --reset-attention-mask the mask depends on the data and every stage reads (as above).
- Each batch's broadcasts are preceded by a small header (status, shapes): the end of the
  stream and a reading error travel to every rank of the group, which stop or raise together
  instead of waiting in a broadcast that never comes.
- Every batch's token ids are checked against the (unpadded) vocabulary on the reading rank
  (``build_data_iterator``, a max and a min per micro-batch): an id outside it would index past
  the embedding at TP=1 and be silently zeroed by the vocab-parallel embedding at TP>1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state

from megaloop.data.datasets import BATCH_KEYS, TokenIdError, build_data_iterator
from megaloop.device import current_device

DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
          "position_ids": torch.int64, "attention_mask": torch.bool}
_OK, _END, _TOKEN_ERROR, _ERROR = 0, 1, 2, 3
_DIMS = 4  # attention_mask is [mbs, 1, seq, seq]; the others [mbs, seq]
_HEADER = 2 + _DIMS * len(BATCH_KEYS)  # status, message length, one shape per key


@dataclass
class BatchSpec:
    """What every rank knows about the batches without reading them."""

    micro_batch_size: int
    seq_length: int  # tokens per sample (a rank holds seq_length / CP of them)
    attention_mask: bool  # --reset-attention-mask: batches carry a data-dependent mask
    vocab_size: int  # the tokenizer's, unpadded: larger ids are data errors


def stage_uses_batch(spec: BatchSpec) -> bool:
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=True) or spec.attention_mask)


def reads_data(spec: BatchSpec) -> bool:
    """Whether this rank builds the datasets and samples batches (TP rank 0 of a stage that
    uses them)."""
    return stage_uses_batch(spec) and parallel_state.get_tensor_model_parallel_rank() == 0


def batch_stream(dataset, spec: BatchSpec, consumed_samples: int, data_parallel_rank: int,
                 data_parallel_size: int, num_workers: int = 0, cyclic: bool = False
                 ) -> Iterator[dict]:
    """This rank's micro-batches (``build_data_iterator``'s stream on every rank that uses it).
    ``dataset`` is None on ranks that do not read (``reads_data`` false)."""
    if not stage_uses_batch(spec):
        return _placeholders(spec)
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return _receive(group, src)
    if dataset is None:
        raise ValueError("the reading rank of a tensor-parallel group has no dataset")
    batches = build_data_iterator(dataset, consumed_samples, spec.micro_batch_size,
                                  data_parallel_rank, data_parallel_size, num_workers, cyclic,
                                  vocab_size=spec.vocab_size)
    if torch.distributed.get_world_size(group) == 1:
        return batches
    return _send(batches, group, src)


def _header(status: int, message: bytes = b"", batch: Optional[dict] = None) -> torch.Tensor:
    values = [status, len(message)]
    for key in BATCH_KEYS:
        shape = list(batch[key].shape) if batch is not None and key in batch else []
        values += shape + [-1] * (_DIMS - len(shape))
    return torch.tensor(values, dtype=torch.int64, device=current_device())


def _broadcast(tensor: torch.Tensor, group, src: int) -> None:
    # gloo has no bool broadcast: send the mask's bytes.
    view = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
    torch.distributed.broadcast(view, src, group=group)


def _send(batches: Iterator[dict], group, src: int) -> Iterator[dict]:
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            _broadcast(_header(_END), group, src)
            return
        except Exception as err:  # the group's other ranks raise it too, instead of hanging
            token = isinstance(err, TokenIdError)
            message = (str(err) if token else f"{type(err).__name__}: {err}").encode()
            _broadcast(_header(_TOKEN_ERROR if token else _ERROR, message), group, src)
            _broadcast(torch.tensor(list(message), dtype=torch.uint8, device=current_device()),
                       group, src)
            raise
        _broadcast(_header(_OK, batch=batch), group, src)
        for key in BATCH_KEYS:
            if key in batch:
                _broadcast(batch[key].contiguous(), group, src)
        yield batch


def _receive(group, src: int) -> Iterator[dict]:
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64, device=current_device())
        _broadcast(header, group, src)
        status, length, *dims = header.tolist()
        if status == _END:
            return
        if status in (_TOKEN_ERROR, _ERROR):
            message = torch.empty(length, dtype=torch.uint8, device=current_device())
            _broadcast(message, group, src)
            text = bytes(message.tolist()).decode()
            if status == _TOKEN_ERROR:
                raise TokenIdError(text)
            raise RuntimeError(f"tensor-parallel rank 0, which reads the data, failed: {text}")
        batch = {}
        for i, key in enumerate(BATCH_KEYS):
            shape = [d for d in dims[i * _DIMS:(i + 1) * _DIMS] if d >= 0]
            if shape:
                batch[key] = torch.empty(shape, dtype=DTYPES[key], device=current_device())
                _broadcast(batch[key], group, src)
        yield batch


def _placeholders(spec: BatchSpec) -> Iterator[dict]:
    shape = (spec.micro_batch_size,
             spec.seq_length // parallel_state.get_context_parallel_world_size())
    batch = {key: torch.empty(shape, dtype=DTYPES[key], device="meta")
             for key in ("tokens", "labels", "loss_mask", "position_ids")}
    while True:
        yield dict(batch)
