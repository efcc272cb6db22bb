"""bench/real_vocab.py: the tokenizer that covers Qwen2.5's vocabulary and the filler rows' probability mass (the
rebuilt model itself: tests/benchmarks/e2e/test_real_vocab_e2e.py)."""


import pytest
import torch

from bench import real_vocab as R


def test_tokenizer_covers_the_vocabulary_and_keeps_the_demos_ids():
    from fastcov.trainer.data.synthetic import build_tokenizer

    small, big = build_tokenizer(), R.build_tokenizer()
    assert len(big) == R.VOCAB == 151_936
    text = "<|im_start|>user\nTom has 3 apples and buys 4 more. How many?<|im_end|>\n<|im_start|>assistant\n"
    assert big(text)["input_ids"] == small(text)["input_ids"]
    assert big.apply_chat_template([{"role": "user", "content": "1 + 2"}], add_generation_prompt=True) == \
        small.apply_chat_template([{"role": "user", "content": "1 + 2"}], add_generation_prompt=True)
    assert (big.eos_token_id, big.pad_token_id, big.unk_token_id) == (small.eos_token_id, small.pad_token_id,
                                                                      small.unk_token_id)
    first = len(small)
    assert big.decode([first, R.VOCAB - 1]) == R.filler_name(first) + R.filler_name(R.VOCAB - 1)
    assert big.convert_tokens_to_ids(R.filler_name(77_777)) == 77_777
    with pytest.raises(ValueError, match="vocab must be at least"):
        R.build_tokenizer(10)


def separable_states(m=400, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    axis = torch.randn(d, generator=g)
    axis = axis / axis.norm()
    states = torch.randn(m, d, generator=g) + 3.0 * axis  # every state on the positive side of ``axis``, mostly
    return states[(states @ axis) > 0.5], torch.randn(30, d, generator=g)


@pytest.mark.parametrize("mass", [1e-3, 0.05])
def test_filler_rows_carry_the_asked_mass_on_average(mass):
    states, head = separable_states()
    rows, stats = R.filler_rows(states, head, n_fillers=5000, mass=mass, seed=1)
    assert rows.shape == (5000, states.shape[1]) and stats["reached"] and stats["min_projection"] > 0
    # the definition, from the full logits in float64: the fillers' summed probability at each state
    logits = states.double() @ torch.cat([head, rows]).double().T
    share = torch.softmax(logits, dim=1)[:, head.shape[0]:].sum(1)
    assert float(share.mean()) == pytest.approx(mass, rel=1e-3)  # bisection to 2^-50 of the bracket: rounding only
    assert float(share.max()) == pytest.approx(stats["filler_mass_max"], rel=1e-3)
    assert rows.std(0).mean() > 0  # each filler its own row (ε), not copies


def test_filler_rows_say_when_no_direction_separates_the_states():
    g = torch.Generator().manual_seed(0)
    states = torch.randn(300, 4, generator=g)  # centred: every direction has states on both sides
    _, stats = R.filler_rows(states, torch.randn(10, 4, generator=g), n_fillers=2000, mass=1e-3, seed=0)
    assert not stats["reached"] and stats["min_projection"] < 0 and stats["filler_mass_mean"] > 1e-3
