"""The batched sampler (megaloop/inference/sampling.py) against hand computations.

- its uniforms are SplitMix64's, recomputed here in Python integers modulo 2**64;
- drawn over 40000 counters, the frequencies match the distribution computed here by hand
  (temperature, then the k largest, then the smallest set reaching p), within 5 standard errors
  per token, and a token outside the kept set never appears;
- a row's tokens are the same alone and inside a batch of rows with other settings;
- greedy is argmax; a row that cannot be sampled is reported alone.
"""

import pytest
import torch

from megaloop.inference.sampling import sample_rows, uniforms

M64 = (1 << 64) - 1


def _splitmix(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed,stream,counter", [(0, 0, 0), (7, 3, 11), (2 ** 64 - 1, 1, 5),
                                                 (-2 ** 63, 0, 2 ** 40)])
def test_uniforms_are_splitmix64_of_seed_stream_counter(seed, stream, counter):
    x = _splitmix((_splitmix((_splitmix(seed & M64) + stream) & M64) + counter) & M64)
    expected = ((x >> 11) + 0.5) / 2 ** 53
    signed = seed - (1 << 64) if seed >= 1 << 63 else seed
    got = uniforms(torch.tensor([signed]), torch.tensor([stream]), torch.tensor([counter]))
    assert got.item() == expected


def _by_hand(logits, temperature, top_k, top_p):
    """The kept tokens' probabilities, by the textbook recipe, one token at a time."""
    z = [v / temperature for v in logits.tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:top_k] if top_k else order
    m = max(z[i] for i in kept)
    w = {i: torch.tensor(z[i] - m, dtype=torch.float64).exp().item() for i in kept}
    total = sum(w.values())
    chosen, mass = [], 0.0
    for i in kept:  # most likely first, until the mass before a token reaches p
        if chosen and mass >= top_p:
            break
        chosen.append(i)
        mass += w[i] / total
    total = sum(w[i] for i in chosen)
    return {i: w[i] / total for i in chosen}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0),
                                                     (1.3, 0, 0.8), (0.9, 12, 0.9)])
def test_frequencies_follow_the_hand_computed_distribution(temperature, top_k, top_p):
    vocab, n = 40, 40000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    tokens, ok = sample_rows(logits.expand(n, vocab).contiguous(), [temperature] * n,
                             [top_k] * n, [top_p] * n, [99] * n, [0] * n, list(range(n)))
    assert bool(ok.all())
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expected = _by_hand(logits, temperature, top_k, top_p)
    for token in range(vocab):
        p = expected.get(token, 0.0)
        if p == 0.0:
            assert freq[token] == 0, (token, freq[token])
        else:
            assert abs(freq[token].item() - p) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-4, \
                (token, freq[token].item(), p)


def test_a_row_samples_alike_alone_and_in_any_batch():
    vocab = 64
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(5, vocab, generator=g) * 3
    settings = [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 7, 0.95), (2.0, 3, 1.0), (1.0, 0, 0.5)]
    seeds, streams = [11, 12, 11, 2 ** 64 - 1, -5], [0, 0, 1, 4, 2]
    for counter in range(20):
        counters = [counter + i for i in range(5)]
        batch, _ = sample_rows(rows, [s[0] for s in settings], [s[1] for s in settings],
                               [s[2] for s in settings], seeds, streams, counters)
        for i in range(5):
            alone, _ = sample_rows(rows[i:i + 1], [settings[i][0]], [settings[i][1]],
                                   [settings[i][2]], [seeds[i]], [streams[i]], [counters[i]])
            assert alone.item() == batch[i].item(), (counter, i)
    # another stream (or seed) is another sequence of draws
    draws = [sample_rows(rows[:1].expand(50, vocab), [1.0] * 50, [0] * 50, [1.0] * 50,
                         [11] * 50, [s] * 50, list(range(50)))[0].tolist() for s in (0, 1)]
    assert draws[0] != draws[1]


def test_greedy_is_argmax_and_a_broken_row_fails_alone():
    logits = torch.tensor([[0.1, 3.0, -1.0], [float("nan"), 1.0, 0.0], [1.0, 2.0, 0.5],
                           [2.0, 1.0, 0.0], [float("-inf")] * 3])
    tokens, ok = sample_rows(logits, [0.0, 1.0, 1e-45, 1.0, 1.0], [0] * 5, [1.0] * 5,
                             [1] * 5, [0] * 5, [0] * 5)
    # row 1: NaN; row 2: logits / 1e-45 overflow; row 4: nothing finite
    assert ok.tolist() == [True, False, False, True, False]
    assert tokens[0].item() == 1
