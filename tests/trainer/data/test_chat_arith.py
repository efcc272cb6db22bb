"""The chat arithmetic task (trainer/data/chat_arith.py): every answer is the expression's value, operands have the
level's digits, train and validation are disjoint, the worked example is of the same level and not the question,
and the math reward scores the worked reply 1 and a wrong one 0."""

import random

import pytest

from fastcov.trainer.data.chat_arith import LEVELS, Level, generate, messages, sample_problem, to_rows, write_task


@pytest.mark.parametrize("level", LEVELS + (Level(4, 3),))
def test_problems_have_the_levels_shape_and_exact_answers(level):
    rng = random.Random(level.name)
    for _ in range(300):
        p = sample_problem(rng, level)
        assert len(p.operands) == level.ops + 1 and len(p.signs) == level.ops
        lo = 1 if level.digits == 1 else 10 ** (level.digits - 1)
        assert all(lo <= x < 10 ** level.digits for x in p.operands)
        # the answer, recomputed from the text itself: left to right, never negative on the way
        tokens = p.expression.split()
        total = int(tokens[0])
        for sign, x in zip(tokens[1::2], tokens[2::2], strict=True):
            total = total + int(x) if sign == "+" else total - int(x)
            assert total >= 0
        assert total == p.answer
        assert p.question() == f"What is {p.expression}? Put the final answer in \\boxed{{}}."


def test_levels_parse_and_refuse():
    assert Level.parse("d2o1") == Level(2, 1) == Level.parse(" 2,1 ") and Level(3, 2).name == "d3o2"
    for bad in ("d0o1", "d2o0", "x", "d2o", "2"):
        with pytest.raises(ValueError, match="level: expected dDoO|digits|ops"):
            Level.parse(bad)


def test_train_and_val_are_disjoint_and_the_example_is_another_problem(tmp_path):
    import pandas as pd

    write_task(str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"), 200, 40, Level(2, 1))
    train, val = pd.read_parquet(tmp_path / "train.parquet"), pd.read_parquet(tmp_path / "val.parquet")
    assert len(train) == 200 and len(val) == 40
    q = {row[-1]["content"] for row in train["prompt"]}
    assert len(q) == 200 and not q & {row[-1]["content"] for row in val["prompt"]}
    for df in (train, val):
        for prompt, truth in zip(df["prompt"], df["reward_model"], strict=True):
            user, reply, question = prompt
            assert [m["role"] for m in prompt] == ["user", "assistant", "user"]
            assert user["content"] != question["content"] and user["content"].startswith("What is ")
            assert reply["content"].endswith("}") and truth["ground_truth"].isdigit()
    assert set(train["data_source"]) == {"chat_arith_d2o1"}


def test_the_math_reward_scores_the_worked_reply():
    from fastcov.trainer.rewards.math_task import RewardFn

    reward = RewardFn(sandbox="inline")
    try:
        for p in generate(20, 3, Level(2, 2)):
            assert reward(p.worked(), str(p.answer)) == 1.0
            assert reward(p.worked().replace(f"{{{p.answer}}}", f"{{{p.answer + 1}}}"), str(p.answer)) == 0.0
            assert reward(f"{p.answer}", str(p.answer)) == 0.0  # no box: no reward, as in the demo
    finally:
        reward.close()


def test_zero_shots_is_the_question_alone():
    p = generate(1, 0, Level(1, 1))[0]
    assert messages(p, None) == [{"role": "user", "content": p.question()}]
    assert to_rows([p], Level(1, 1), "test", shots=0)[0]["prompt"] == messages(p, None)


def test_a_small_level_trains_on_all_its_problems(tmp_path):
    import pandas as pd

    write_task(str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"), 512, 16, Level(1, 1))
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert len(train) == 126 - 16  # 81 sums and 45 differences a >= b of 1..9, less the validation ones
    for prompt in train["prompt"]:
        assert prompt[0]["content"] != prompt[-1]["content"]  # the example is never the question
    with pytest.raises(ValueError, match="only 126 distinct d1o1 problems exist, asked 200"):
        generate(200, 0, Level(1, 1))
