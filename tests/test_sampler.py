"""The HF engine's sampler: the inverse CDF by hand, rare tokens at their rate, samples that depend
neither on the batch nor on the rank."""
import math

import torch

import problems
import rollout
from rollout import HFEngine


def test_sample_token_is_the_inverse_cdf_by_hand():
    """p = [.5, .3, .2] (logits shifted by 3: the CDF is scaled by its total). u below .5 draws token 0,
    below .8 token 1, then 2; temperature .5 gives p ~ p^2 = [.658, .237, .105]; top_p .7 keeps tokens 0
    and 1 ([.625, .375]); temperature 0 is the argmax. An off-by-one at a boundary, an unscaled CDF or a
    temperature applied twice moves one of these."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log() + 3.0
    draw = lambda us, t=1.0, top_p=1.0: rollout.sample_token(  # noqa: E731
        logits.expand(len(us), 3), torch.tensor(us, dtype=torch.float64), t, top_p).tolist()
    assert draw([0.0, 0.4999, 0.5001, 0.7999, 0.8001, 0.99999]) == [0, 0, 1, 1, 2, 2]
    assert draw([0.65, 0.66, 0.89, 0.9], t=0.5) == [0, 1, 1, 2]
    assert draw([0.6, 0.63, 0.99999], top_p=0.7) == [0, 1, 1]
    assert draw([0.99999, 0.0], t=0) == [0, 0]


def test_sample_token_draws_a_one_in_a_trillion_token_at_its_rate():
    """p1 = 1e-12: it is drawn for u in [1 - 1e-12, 1) and only there. A float32 CDF rounds it away."""
    logits = torch.tensor([[0.0, math.log(1e-12)]]).expand(3, 2)
    u = torch.tensor([1 - 0.5e-12, 1 - 2e-12, 0.5], dtype=torch.float64)
    assert rollout.sample_token(logits, u, 1.0).tolist() == [1, 0, 0]


def test_hf_engine_samples_do_not_depend_on_the_batch_and_match_the_model(tiny):
    """A prompt's samples are the same alone and beside a longer prompt (it is then left-padded: a pad
    that is attended changes them); greedy decoding equals HF `generate`'s; and a token's frequencies
    over 600 samples match the model's softmax."""
    d, tok = tiny
    engine = HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id)
    short, long = problems.encode_prompt(tok, "What is 1 + 2?"), problems.encode_prompt(tok, "What is 3 + 4? " * 3)
    alone = engine.generate([short], 3, 1.0, 1.0, 8, [11])[0]
    beside = engine.generate([long, short], 3, 1.0, 1.0, 8, [5, 11])[1]
    assert [s.tokens for s in alone] == [s.tokens for s in beside]
    for prompt in (short, long):
        (greedy,) = engine.generate([prompt], 1, 0.0, 1.0, 8, [0])[0]
        ids = torch.tensor([prompt])
        want = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert greedy.tokens == want[:len(greedy.tokens)]
    boxed = short + tok("\\boxed{", add_special_tokens=False)["input_ids"]  # the digit after it is uncertain
    first = [s.tokens[0] for s in engine.generate([boxed], 600, 1.0, 1.0, 1, [3])[0]]
    with torch.no_grad():
        p = engine.model(torch.tensor([boxed])).logits[0, -1].softmax(-1)
    assert p.max() < 0.5  # spread out: a sampler at the wrong temperature shows
    freq = torch.bincount(torch.tensor(first), minlength=len(p)) / 600
    assert 0.5 * (freq - p).abs().sum() < 0.07  # total variation 0.041; at temperature 0.7 it is 0.11
