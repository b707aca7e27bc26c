"""Batches read once per tensor-parallel group (megaloop/data/broadcast.py), token ids checked
against the vocabulary, and the data errors raised before any process group starts.

The reference stream is computed independently, in this process without any process group: the
datasets built and sampled directly (``build_data_iterator``), as every rank did before.
"""

import itertools
import json

import pytest
import torch

from distributed import run_distributed
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.data.datasets import (TokenIdError, build_data_iterator,
                                    build_train_valid_test_datasets)
from megaloop.data.preprocess import preprocess
from megaloop.data.tokenizers import build_tokenizer
from flags import TEST_FLAGS

VOCAB = 500  # NullTokenizer --vocab-size 500: ids 0..499, EOD 500, vocabulary of 501 ids
SEQ, MBS, SAMPLES = 16, 2, 24


def _dataset(path, docs) -> str:
    with open(f"{path}.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": " ".join(map(str, d))}) + "\n")
    preprocess(f"{path}.jsonl", str(path), TokenizerConfig(vocab_size=VOCAB), workers=0,
               append_eod=True, progress=False)
    return f"{path}_text_document"


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    a = _dataset(tmp / "a", [[1 + i % 50] * (3 + i % 17) for i in range(90)])
    b = _dataset(tmp / "b", [[100 + i % 50] * (4 + i % 9) for i in range(60)])
    return DataConfig(data_path=["0.4", a, "0.6", b], split="100,0,0",
                      data_cache_path=str(tmp / "cache"))


def _reference_body(rank, world, cfg, reset_mask, vocab_size):
    cfg = DataConfig(**{**cfg.__dict__, "reset_attention_mask": reset_mask})
    train, _, _ = build_train_valid_test_datasets(
        cfg, build_tokenizer(TokenizerConfig(vocab_size=VOCAB)), SEQ, 3, (SAMPLES, 0, 0))
    try:
        return list(build_data_iterator(train, 0, MBS, 0, 1, vocab_size=vocab_size))
    except TokenIdError as err:
        return f"TokenIdError: {err}"


def _reference(cfg: DataConfig, reset_mask: bool = False, vocab_size=None):
    """The stream as one rank reads it (a blend needs a process group: a world of one)."""
    return run_distributed(_reference_body, 1, cfg, reset_mask, vocab_size)[0]


def _rank_stream(rank, world, cfg, tp, pp, reset_mask, vocab_size):
    """This rank's batches through batch_stream, and whether it built datasets."""
    from megatron.core import parallel_state

    from megaloop.data.broadcast import BatchSpec, batch_stream, reads_data
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), 3)
    cfg = DataConfig(**{**cfg.__dict__, "reset_attention_mask": reset_mask})
    spec = BatchSpec(MBS, SEQ, reset_mask, vocab_size)
    train, _, _ = build_train_valid_test_datasets(
        cfg, build_tokenizer(TokenizerConfig(vocab_size=VOCAB)), SEQ, 3, (SAMPLES, 0, 0),
        built_on_this_rank=reads_data(spec))
    where = (parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_pipeline_model_parallel_rank())
    try:
        batches = [{k: (v if v.device.type == "meta" else v.cpu()) for k, v in b.items()}
                   # one more than the readers' stream holds: placeholders never end
                   for b in itertools.islice(batch_stream(train, spec, 0, 0, 1),
                                             SAMPLES // MBS + 1)]
    except TokenIdError as err:
        return where, train is not None, f"TokenIdError: {err}"
    # Placeholders are meta tensors: shapes and dtypes only, sent back as such.
    return where, train is not None, [
        {k: (("meta", tuple(v.shape), v.dtype) if v.device.type == "meta" else v)
         for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_sees_the_reference_tokens_only_tp_rank_0_reads(blend, tp, pp):
    ref = _reference(blend)
    assert len(ref) == SAMPLES // MBS
    for (tp_rank, _), built, batches in run_distributed(
            _rank_stream, tp * pp, blend, tp, pp, False, VOCAB + 1):
        assert built == (tp_rank == 0)  # the DataLoader and datasets live on TP rank 0 only
        assert len(batches) == len(ref)  # the end of the stream reached every rank
        for got, want in zip(batches, ref):
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_middle_stage_gets_shapes_only_unless_the_mask_needs_data(blend):
    ref = _reference(blend)
    for (_, pp_rank), built, batches in run_distributed(
            _rank_stream, 3, blend, 1, 3, False, VOCAB + 1):
        assert built == (pp_rank != 1)
        if pp_rank == 1:  # no data read: meta placeholders of the right shapes and dtypes
            assert len(batches) == len(ref) + 1
            for b in batches:
                assert b == {k: ("meta", (MBS, SEQ), ref[0][k].dtype) for k in ref[0]}
        else:
            assert all(torch.equal(g["tokens"], w["tokens"]) for g, w in zip(batches, ref))
    ref = _reference(blend, reset_mask=True)  # a data-dependent mask: every stage reads it
    for (_, pp_rank), built, batches in run_distributed(
            _rank_stream, 3, blend, 1, 3, True, VOCAB + 1):
        assert built and len(batches) == len(ref)
        for got, want in zip(batches, ref):
            assert torch.equal(got["attention_mask"], want["attention_mask"])
            assert torch.equal(got["tokens"], want["tokens"])


@pytest.fixture(scope="module")
def bad_blend(tmp_path_factory):
    """Dataset b holds an id (777) beyond a 501-id vocabulary in every 4th document; a none."""
    tmp = tmp_path_factory.mktemp("bad")
    a = _dataset(tmp / "a", [[1 + i % 50] * 5 for i in range(40)])
    b = _dataset(tmp / "b", [[100 + i % 50] * 5 + ([777] if i % 4 == 3 else [])
                             for i in range(40)])
    return b, DataConfig(data_path=["0.5", a, "0.5", b], split="100,0,0",
                         data_cache_path=str(tmp / "cache"))


def test_token_id_beyond_vocabulary_fails_naming_dataset_id_and_size(bad_blend):
    b, cfg = bad_blend
    # VOCAB + 1 ids: NullTokenizer's vocabulary (its --vocab-size ids plus EOD)
    message = _reference(cfg, vocab_size=VOCAB + 1)
    assert message.startswith(f"TokenIdError: {b}: token id 777 "), message
    assert "vocabulary of 501 ids" in message
    # Independent of the check: the stream really holds 777 and nothing else out of range.
    stream = _reference(cfg)
    ids = torch.cat([x["tokens"] for x in stream] + [x["labels"] for x in stream])
    assert int(ids.max()) == 777 and int(ids[ids != 777].max()) <= VOCAB
    # A vocabulary that covers the data passes.
    assert len(_reference(cfg, vocab_size=778)) == SAMPLES // MBS


@pytest.mark.parametrize("tp", [1, 2])
def test_token_id_check_on_every_tensor_parallel_rank(bad_blend, tp):
    b, cfg = bad_blend
    results = run_distributed(_rank_stream, tp, cfg, tp, 1, False, VOCAB + 1)
    for _, _, outcome in results:  # the reading rank and its peer fail alike, nobody hangs
        assert outcome.startswith(f"TokenIdError: {b}: token id 777 "), outcome


def _run_config_error(argv) -> str:
    from megaloop.training.run_config import parse_args

    cfg = parse_args([*TEST_FLAGS,
                      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "16", "--max-position-embeddings", "16",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"] + argv)
    with pytest.raises(ValueError) as err:
        cfg.validate(world_size=1)
    assert not torch.distributed.is_initialized()  # refused before any process group
    return str(err.value)


def test_blend_and_split_mistakes_refused_at_validation(blend):
    a = blend.data_path[1]
    message = _run_config_error(["--data-path", "0.5", a, "0.5"])
    assert "weight/prefix pairs, but 3 values" in message
    message = _run_config_error(["--data-path", a, "--split", "100,0,0", "--eval-iters", "3"])
    assert "--eval-iters 0" in message and "--split 100,0,0" in message


def _train_one_step(rank, world, argv):
    from run_helpers import build_trainer

    trainer = build_trainer(argv)
    try:
        trainer.train_step()
    except TokenIdError as err:
        return f"TokenIdError: {err}"
    return "trained"


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_stops_on_token_id_beyond_vocabulary(bad_blend, tp):
    """Through the trainer: at TP=1 the embedding would raise an IndexError naming nothing, at
    TP=2 the vocab-parallel embedding would silently read zeros for id 777."""
    b, cfg = bad_blend
    argv = [*TEST_FLAGS, "--num-layers", "2", "--num-loops", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings",
            str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--eval-iters", "0",
            "--data-path", *cfg.data_path, "--split", "100,0,0", "--data-cache-path",
            cfg.data_cache_path, "--tensor-model-parallel-size", str(tp)]
    for outcome in run_distributed(_train_one_step, tp, argv):
        assert outcome.startswith(f"TokenIdError: {b}: token id 777 "), outcome
    # The same run on a vocabulary that covers 777 trains.
    argv[argv.index("--vocab-size") + 1] = "800"
    assert run_distributed(_train_one_step, tp, argv) == ["trained"] * tp
