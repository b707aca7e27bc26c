"""The shim's transfer counter (megaloop.cpu_shim.count_transfers): on CPU, the copies between
host and GPU memory a GPU run would make, from the placement check's marks.

Each snippet below is one line with a count known by hand (torch's semantics on CUDA); the
counter must find exactly that many host-to-device and device-to-host copies, name the line, and
say which host-to-device copies would block (pageable source, or no ``non_blocking=True``).
"""

import operator
import os

import numpy as np
import pytest
import torch

from distributed import run_distributed
from megaloop import cpu_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the counter reads the placement check, a CPU mode")


def _count(fn):
    """(h2d records, d2h records) of ``fn()``, each record a plain tuple for the parent."""
    with cpu_shim.count_transfers() as seen:
        fn()
    return ([(r.op, r.where, r.blocking, r.pinned, r.non_blocking) for r in seen.h2d],
            [(r.op, r.where, r.blocking, r.pinned, r.non_blocking) for r in seen.d2h])


def _snippets():
    """name -> (one-line snippet, h2d copies, d2h copies) on a GPU. The tensors are made before
    the counting starts, so only the snippet's own copies count."""
    acc = torch.cuda.current_device()
    placed = torch.arange(6.0, device=acc)
    ints = torch.arange(3, device=acc)
    host = torch.ones(6)
    buffer = torch.zeros(6)
    return {
        # host -> device
        "torch.tensor": (lambda: torch.tensor([1, 2], device="cuda"), 1, 0),
        "torch.tensor scalar": (lambda: torch.tensor(3.0, device=acc), 1, 0),
        "torch.tensor at x.device": (lambda: torch.tensor([1], device=placed.device), 1, 0),
        "as_tensor of a host tensor": (lambda: torch.as_tensor(host, device=acc), 1, 0),
        "asarray of numpy": (lambda: torch.asarray(np.ones(3), device="cuda"), 1, 0),
        "new_tensor": (lambda: placed.new_tensor([1.0, 2.0]), 1, 0),
        "cuda()": (lambda: host.cuda(), 1, 0),
        "to(cuda)": (lambda: host.to("cuda"), 1, 0),
        "to(current_device, dtype)": (lambda: host.to(acc, torch.float64), 1, 0),
        "to(x.device)": (lambda: host.to(placed.device), 1, 0),
        "to(placed tensor)": (lambda: host.to(placed), 1, 0),
        "copy_ into placed": (lambda: placed.copy_(host), 1, 0),
        "host index tensor": (lambda: placed[torch.tensor([0, 2])], 1, 0),
        "list index": (lambda: placed[[0, 2]], 1, 0),
        "setitem of a host value": (lambda: placed.__setitem__(slice(0, 2), torch.ones(2)), 1, 0),
        # device -> host
        "tolist": (lambda: placed.tolist(), 0, 1),
        "item": (lambda: placed[0].item(), 0, 1),
        "bool": (lambda: bool(placed[1]), 0, 1),
        "if": (lambda: 1 if placed[1] > 0 else 0, 0, 1),
        "int": (lambda: int(placed[1]), 0, 1),
        "float": (lambda: float(placed[1]), 0, 1),
        "index": (lambda: operator.index(ints[1]), 0, 1),
        "list[t]": (lambda: [10, 11, 12][ints[2]], 0, 1),
        "range(t)": (lambda: range(ints[2]), 0, 1),
        "repr": (lambda: repr(placed), 0, 1),
        "print format": (lambda: f"{placed[0]:.1f}", 0, 1),
        "cpu()": (lambda: placed.cpu(), 0, 1),
        "to('cpu')": (lambda: placed.to("cpu"), 0, 1),
        "to(torch.device('cpu'))": (lambda: placed.to(torch.device("cpu")), 0, 1),
        "to(host.device)": (lambda: placed.to(host.device), 0, 1),
        "to(host tensor)": (lambda: placed.to(host), 0, 1),
        "numpy(force=True)": (lambda: placed.numpy(force=True), 0, 1),
        "copy_ into host": (lambda: buffer.copy_(placed), 0, 1),
        "torch.tensor of placed scalars": (lambda: torch.tensor([placed[0], placed[1]]), 0, 2),
        "and onto the device": (lambda: torch.tensor([placed[0]], device=acc), 1, 1),
        "both ways": (lambda: host.cuda().sum().item(), 1, 1),
        # neither: made on the device, kept on one side, or empty
        "zeros on device": (lambda: torch.zeros(3, device=acc), 0, 0),
        "arange at x.device": (lambda: torch.arange(3, device=placed.device), 0, 0),
        "full with a python fill": (lambda: torch.full((2,), 7.0, device="cuda"), 0, 0),
        "empty/ones_like/scalar_tensor": (lambda: (torch.empty(2, device=acc),
                                                   torch.ones_like(placed),
                                                   torch.scalar_tensor(2.0, device=acc)), 0, 0),
        "device math": (lambda: (placed * placed + 1).sum(), 0, 0),
        "placed moves": (lambda: (placed.to(acc), placed.cuda(), placed.to(torch.float64)), 0, 0),
        "device copies": (lambda: (placed.copy_(placed * 2), torch.as_tensor(placed, device=acc),
                                   placed.new_tensor(placed)), 0, 0),
        "basic indexing": (lambda: (placed[0], placed[1:3], placed[torch.tensor(1)]), 0, 0),
        "scalar fills": (lambda: (placed.__setitem__(0, 5.0),
                                  placed.__setitem__(slice(1, 3), torch.tensor(5.0))), 0, 0),
        "metadata": (lambda: (placed.shape, placed.device, len(placed), placed.numel(),
                              placed.dtype, placed.is_pinned()), 0, 0),
        "host only": (lambda: (host.tolist(), host[0].item(), bool(host[0]), host.cpu(),
                               host.numpy(), repr(host), torch.tensor([1, 2])), 0, 0),
        "empty": (lambda: (torch.empty(0).cuda(), torch.tensor([], device=acc),
                           torch.tensor([[]], device="cuda"), placed[:0].tolist(),
                           placed[:0].cpu()), 0, 0),
    }


def _counted(rank, world):
    cpu_shim.enable_placement_check()
    out = {}
    for name, (fn, h2d, d2h) in _snippets().items():
        out[name] = (_count(fn), (h2d, d2h),
                     f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}")
    return out


@pytest.fixture(scope="module")
def counted():
    return run_distributed(_counted, 1)[0]


def test_each_copy_counted_once_where_it_is(counted):
    """Every snippet's copies, both ways, exactly as many as on a GPU."""
    wrong = {name: ([r[0] for r in h2d], [r[0] for r in d2h], expected)
             for name, ((h2d, d2h), expected, _) in counted.items()
             if (len(h2d), len(d2h)) != expected}
    assert not wrong, wrong
    total = sum(len(h) + len(d) for (h, d), _, _ in counted.values())
    assert total == sum(h + d for _, (h, d), _ in counted.values()) == 39  # the table ran


def test_records_name_the_test_line(counted):
    """Each record's ``where`` is the snippet's own line in this file, not torch's or the shim's."""
    for name, ((h2d, d2h), _, line) in counted.items():
        assert os.path.samefile(line.rsplit(":", 1)[0], __file__)
        for record in h2d + d2h:
            assert record[1] == line, (name, record)


def test_records_name_the_operation(counted):
    ops = {name: ([r[0] for r in h2d], [r[0] for r in d2h])
           for name, ((h2d, d2h), _, _) in counted.items()}
    assert ops["torch.tensor"] == (["torch.tensor"], [])
    assert ops["cuda()"] == (["Tensor.cuda"], [])
    assert ops["to(x.device)"] == (["Tensor.to(cuda)"], [])
    assert ops["copy_ into placed"] == (["Tensor.copy_"], [])
    assert ops["item"] == ([], ["Tensor.item"])
    assert ops["if"] == ([], ["Tensor.__bool__"])
    assert ops["to(torch.device('cpu'))"] == ([], ["Tensor.to(cpu)"])
    assert ops["both ways"] == (["Tensor.cuda"], ["Tensor.item"])
    # Every host-to-device copy from pageable memory blocks, and so does every read into python.
    for name, ((h2d, d2h), _, _) in counted.items():
        assert all(r[2] and not r[3] for r in h2d + d2h), name


def _pinned(rank, world):
    cpu_shim.enable_placement_check()
    acc = torch.cuda.current_device()
    placed = torch.arange(6.0, device=acc)
    host = torch.ones(6)
    pinned = torch.ones(6).pin_memory()
    staging = torch.empty(6, pin_memory=True)
    landing = torch.empty(6, pin_memory=True)
    out = {"is_pinned": (pinned.is_pinned(), staging.is_pinned(), staging[2:].is_pinned(),
                         host.is_pinned(), (pinned + 0).is_pinned(),
                         cpu_shim.is_host(pinned), pinned.pin_memory() is pinned)}
    cases = {
        "pinned, non_blocking": lambda: pinned.to(acc, non_blocking=True),
        "pinned view, cuda(non_blocking)": lambda: staging[:3].cuda(non_blocking=True),
        "pinned, copy_ non_blocking": lambda: placed.copy_(pinned, non_blocking=True),
        "pinned, to(device, dtype, non_blocking)": lambda: pinned.to(acc, torch.float32, True),
        "pinned, blocking": lambda: pinned.to(acc),
        "pageable, non_blocking": lambda: host.to(acc, non_blocking=True),
        "pageable, derived from pinned": lambda: (pinned + 0).to(acc, non_blocking=True),
        "d2h into pinned, non_blocking": lambda: landing.copy_(placed, non_blocking=True),
        "d2h into pageable, non_blocking": lambda: host.copy_(placed, non_blocking=True),
        "d2h to(cpu, non_blocking)": lambda: placed.to("cpu", non_blocking=True),
    }
    for name, fn in cases.items():
        out[name] = _count(fn)
    out["to(cpu, non_blocking) is pinned"] = placed.to("cpu", non_blocking=True).is_pinned()
    # The table is not the test: a nested counter sees the same copies as the outer one.
    with cpu_shim.count_transfers() as outer:
        pinned.to(acc, non_blocking=True)
        with cpu_shim.count_transfers() as inner:
            host.cuda()
    out["nested"] = (len(outer.h2d), len(inner.h2d), len(outer.blocking), str(inner))
    return out


def test_pinned_non_blocking_copies_do_not_block():
    m = run_distributed(_pinned, 1)[0]
    assert m["is_pinned"] == (True, True, True, False, False, True, True)

    def one(name):
        h2d, d2h = m[name]
        assert len(h2d) + len(d2h) == 1, (name, h2d, d2h)
        op, _, blocking, pinned, non_blocking = (h2d + d2h)[0]
        return blocking, pinned, non_blocking

    assert one("pinned, non_blocking") == (False, True, True)
    assert one("pinned view, cuda(non_blocking)") == (False, True, True)
    assert one("pinned, copy_ non_blocking") == (False, True, True)
    assert one("pinned, to(device, dtype, non_blocking)") == (False, True, True)
    assert one("pinned, blocking") == (True, True, False)
    assert one("pageable, non_blocking") == (True, False, True)
    assert one("pageable, derived from pinned") == (True, False, True)
    assert one("d2h into pinned, non_blocking") == (False, True, True)
    assert one("d2h into pageable, non_blocking") == (True, False, True)
    assert one("d2h to(cpu, non_blocking)") == (False, True, True)  # torch pins the result
    assert m["d2h into pinned, non_blocking"][0] == []  # a device-to-host copy, not the reverse
    assert m["to(cpu, non_blocking) is pinned"]
    outer, inner, blocking, text = m["nested"]
    assert (outer, inner, blocking) == (2, 1, 1)
    assert text.startswith("h2d: blocking Tensor.cuda at ") and "test_transfers.py" in text


def _mistakes(rank, world):
    cpu_shim.enable_placement_check()
    placed = torch.arange(3.0, device=torch.cuda.current_device())
    out = {}
    for name, fn in (("numpy", lambda: placed.numpy()), ("asarray", lambda: np.asarray(placed)),
                     ("pin_memory", lambda: placed.pin_memory()),
                     ("host numpy", lambda: torch.ones(2).numpy())):
        try:
            fn()
            out[name] = None
        except cpu_shim.PlacementError as exc:
            out[name] = str(exc)
    return out


def test_what_fails_on_a_gpu_fails_under_the_check():
    """numpy cannot read CUDA memory and CUDA tensors cannot be pinned: the check says so."""
    m = run_distributed(_mistakes, 1)[0]
    assert "Tensor.numpy() of an accelerator tensor (3,) float32" in m["numpy"]
    assert "numpy.asarray of an accelerator tensor" in m["asarray"]
    assert "pin_memory() of an accelerator tensor" in m["pin_memory"]
    assert m["host numpy"] is None


def test_counter_needs_the_placement_check():
    if cpu_shim.placement_check_enabled():
        pytest.skip("this process runs under the check (MEGALOOP_SHIM_CHECK_PLACEMENT)")
    with pytest.raises(RuntimeError, match="enable_placement_check"):
        with cpu_shim.count_transfers():
            pass


# --- the batching engine's decode step ------------------------------------------------------

def _decode_step_transfers(rank, world, temperature, rule):
    """Transfers of engine steps after the prefill: [(h2d records, d2h records)] per step."""
    from distributed import setup_parallel
    from flags import llama_style
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.inference.generate import SamplingParams
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    cpu_shim.enable_placement_check()
    model = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    max_position_embeddings=64, transformer_impl="local"),
                        LoopConfig(num_loops=3), 128)
    model.cuda().eval()
    engine = InferenceEngine(model, 120, exit_rule=rule and parse_exit(rule),
                             config=EngineConfig(max_sequence_length=40, max_batch=4,
                                                 block_size=4))
    for i, prompt in enumerate(([5, 6, 7], [9, 10, 11, 12, 13])):
        engine.add(prompt, 6, SamplingParams(temperature=temperature, top_k=5, seed=i),
                   ignore_eos=True)
    engine.step()  # the prefill
    steps = []
    for _ in range(3):  # the first decode gathers a fresh view, the next ones reuse it
        steps.append(_count(engine.step))
    return steps, engine.forward_impl


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_decode_step_copies_once_each_way_without_blocking(temperature):
    """A decode step (greedy or sampled, fresh view or reused) sends its integers to the device
    in one non-blocking copy from pinned memory (sampled rows: their settings in non-blocking
    copies too) and reads the step's results back in one transfer."""
    steps, impl = run_distributed(_decode_step_transfers, 1, temperature, None)[0]
    assert impl == "megaloop"
    for h2d, d2h in steps:
        shown = f"h2d {h2d}\nd2h {d2h}"
        assert [r for r in h2d if r[2]] == [], shown  # none blocks
        assert len(h2d) == (1 if temperature == 0 else 5), shown
        assert len(d2h) == 1 and d2h[0][0] == "Tensor.tolist", shown


def test_early_exit_adds_only_its_row_decisions():
    """With an exit rule, a step still makes no blocking host-to-device copy; the reads back it
    adds are early exit's decisions of which rows go on (one or two per loop step)."""
    steps, _ = run_distributed(_decode_step_transfers, 1, 0.0, "q:0.5")[0]
    for h2d, d2h in steps:
        assert [r for r in h2d if r[2]] == [], h2d
        assert len(h2d) == 1
        assert sum(op == "Tensor.tolist" for op, *_ in d2h) == 1, d2h
        assert len(d2h) <= 1 + 2 * 3, d2h
