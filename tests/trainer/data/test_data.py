"""verl-style parquet loading, de-duplication, chat template, splits, the synthetic task."""

import pandas as pd
import pytest

from fastcov.trainer.data import synthetic
from fastcov.trainer.data.loading import PromptSampler, load_examples, read_parquet, split_train_val
from fastcov.trainer.rewards import RewardFn


@pytest.fixture(scope="module")
def tok():
    return synthetic.build_tokenizer()


def _row(content, truth, source="synthetic_arith"):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


def test_loader_dedups_applies_template_and_filters(tmp_path, tok):
    rows = [_row("mia has 3 pens .", "3"), _row("sam has 4 eggs .", "4"),
            _row("mia has 3 pens .", "3"),  # duplicate
            _row("mia has 3 pens . " * 40, "3")]  # too long
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    pd.DataFrame([_row("sam has 4 eggs .", "4"), _row("leo has 2 coins .", "2", "aime")]).to_parquet(
        tmp_path / "b.parquet")
    exs, stats = load_examples([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], tok, max_prompt_len=64)
    assert stats == {"rows": 6, "duplicates": 2, "excluded": 0, "too_long": 1}
    assert [e.ground_truth for e in exs] == ["3", "4", "2"]
    assert exs[2].data_source == "aime"
    text = tok.decode(exs[0].prompt_ids)
    assert text == "<|im_start|>user\nmia has 3 pens .<|im_end|>\n<|im_start|>assistant\n"
    # prompts in a validation set are kept out of training
    ex2, st2 = load_examples([str(tmp_path / "a.parquet")], tok, 64, exclude={exs[1].key})
    assert st2["excluded"] == 1 and [e.ground_truth for e in ex2] == ["3"]


def test_loader_errors_name_the_problem(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_parquet(tmp_path / "missing.parquet")
    pd.DataFrame([{"question": "x", "reward_model": {"ground_truth": "1"}}]).to_parquet(tmp_path / "c.parquet")
    with pytest.raises(ValueError, match="'prompt'"):
        read_parquet(tmp_path / "c.parquet")
    pd.DataFrame([{"prompt": "plain text", "reward_model": {"style": "rule"}}]).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="ground_truth"):
        read_parquet(tmp_path / "d.parquet")


def test_synthetic_task_roundtrip_and_answers_verify(tmp_path, tok):
    synthetic.write_task(str(tmp_path / "t.parquet"), str(tmp_path / "v.parquet"), 50, 10, seed=3)
    train = read_parquet(tmp_path / "t.parquet")
    val = read_parquet(tmp_path / "v.parquet")
    assert len(train) == 50 and len(val) == 10
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in val}
    reward = RewardFn(sandbox="inline")
    for p in synthetic.generate(20, seed=1, max_ops=3):
        assert all(0 <= v <= 9 for v in p.values)
        for style in synthetic.SOLUTION_STYLES:
            text = synthetic.solution(p, style)
            assert reward(text, str(p.answer)) == 1.0
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text  # the tokenizer round-trips the task's text exactly


def test_split_and_sampler_are_seeded_and_resumable():
    items = list(range(100))
    tr, va = split_train_val(items, 0.1, seed=0)
    assert len(va) == 10 and sorted(tr + va) == items
    assert split_train_val(items, 0.1, seed=0) == (tr, va)
    a = PromptSampler(10, seed=1)
    first = a.next(7)
    state = a.state_dict()
    rest = a.next(9)  # crosses an epoch boundary
    b = PromptSampler(10, seed=1)
    b.load_state_dict(state)
    assert b.next(9) == rest
    assert sorted(first + rest[:3]) == list(range(10))
    with pytest.raises(ValueError, match="checkpoint had 10"):
        PromptSampler(11, seed=1).load_state_dict(state)


def test_harder_split_has_exactly_one_operation_more_than_training(tmp_path, tok):
    synthetic.write_task(str(tmp_path / "t.parquet"), str(tmp_path / "v.parquet"), 60, 12, seed=3, max_ops=2,
                         max_value=9, harder_path=str(tmp_path / "h.parquet"))
    raw = pd.read_parquet(tmp_path / "h.parquet")
    assert set(raw["data_source"]) == {synthetic.HARDER_DATA_SOURCE}
    harder = read_parquet(tmp_path / "h.parquet")
    assert len(harder) == 12 and len({r["messages"][0]["content"] for r in harder}) == 12

    def n_ops(q):
        return q.count(" more .") + q.count(" away .")

    train = read_parquet(tmp_path / "t.parquet")
    assert max(n_ops(r["messages"][0]["content"]) for r in train) == 2
    assert all(n_ops(r["messages"][0]["content"]) == 3 for r in harder)
    reward = RewardFn(sandbox="inline")
    for p in synthetic.generate(12, 3 + 2, 3, 3, 9):  # the split's own generator: answers verify, values in range
        assert len(p.ops) == 3 and all(0 <= v <= 9 for v in p.values)
        assert reward(synthetic.solution(p, "steps"), str(p.answer)) == 1.0
    assert [r["ground_truth"] for r in harder] == [str(p.answer) for p in synthetic.generate(12, 5, 3, 3, 9)]
    # without harder_path nothing else is written
    synthetic.write_task(str(tmp_path / "t2.parquet"), str(tmp_path / "v2.parquet"), 20, 5, seed=3)
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.endswith("2.parquet")) == ["t2.parquet", "v2.parquet"]
