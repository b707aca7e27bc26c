"""megaloop.rl.rollouts: group rollouts through megaloop's Generator are reproducible from the
seed (and change with it), lay out prompt + completion with the response mask on exactly the
positions that predict completion tokens, and carry the environment's reward of the completion
text (checked here from the sampled ids themselves)."""

import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style
from test_placement import check_placement

VOCAB = 64  # NullTokenizer(VOCAB - 1): ids 0..62 are text, 63 is EOD


def _model():
    from megaloop.model.config import LoopConfig
    from megaloop.device import current_device
    from megaloop.model.looped_gpt import build_model

    cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=16)
    return build_model(cfg, LoopConfig(num_loops=3), VOCAB).cuda(current_device())


def _rollouts(rank, world, seeds):
    from megaloop.data.tokenizers import NullTokenizer
    from megaloop.inference.generate import Generator, SamplingParams
    from megaloop.rl.environments import Environment, Prompt
    from megaloop.rl.rollouts import rollout

    class EvenSum(Environment):
        """Reward 1 when the ids the completion writes sum to an even number."""

        def prompts(self):
            return [Prompt("5 6 7 8", ""), Prompt("9 10", "")]

        def reward(self, prompt, completion):
            return float(sum(int(x) for x in completion.split()) % 2 == 0)

    check_placement()  # the policy on the device, as in the RL trainer
    setup_parallel(world)
    torch.manual_seed(0)
    model = _model()
    tokenizer = NullTokenizer(VOCAB - 1)
    generator = Generator(model, vocab_size=VOCAB, eod=tokenizer.eod)
    env = EvenSum()
    out = []
    for seed in seeds:
        params = SamplingParams(temperature=1.0, seed=seed)
        r = rollout(generator, tokenizer, env, env.prompts(), group_size=3, max_tokens=5,
                    params=params)
        # The Generator's own output for these prompts (once: the layout is checked against it).
        direct = None if out else generator.generate([[5, 6, 7, 8]] * 3 + [[9, 10]] * 3, 5,
                                                     params)
        out.append((r.tokens, r.response_mask, r.rewards, r.completions, direct))
    return out


def test_rollouts_are_seeded_laid_out_and_rewarded():
    (t1, m1, r1, c1, direct), (t2, m2, r2, _, _), (t3, _, _, _, _) = run_distributed(
        _rollouts, 1, [3, 3, 4])[0]
    assert torch.equal(t1, t2) and torch.equal(m1, m2) and torch.equal(r1, r2)
    assert not torch.equal(t1, t3)  # another seed, other samples
    assert r1.shape == (2, 3)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 3
    for b, (p, out) in enumerate(zip(prompts, direct)):
        assert 1 <= len(out) <= 5
        row = p + out
        assert t1[b, :len(row)].tolist() == row and (t1[b, len(row):] == VOCAB - 1).all()
        # Position j predicts token j + 1: the completion's tokens are j + 1 in
        # [len(p), len(p) + len(out)).
        want = [float(len(p) <= j + 1 < len(p) + len(out)) for j in range(t1.shape[1] - 1)]
        assert m1[b].tolist() == want
        text_ids = out[:-1] if out[-1] == VOCAB - 1 else out
        assert r1[b // 3, b % 3].item() == float(sum(text_ids) % 2 == 0)
        assert c1[b] == "".join(f" {i}" for i in text_ids)
