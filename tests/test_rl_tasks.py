"""The arithmetic task, the reward functions and their errors."""

import math

import pytest

from aurora.rl.tasks import (
    ArithmeticConfig,
    ArithmeticTask,
    RewardError,
    answer_reward,
    arithmetic_reward,
    extract_answer,
    gsm8k_arithmetic_reward,
    score,
    solve,
)


def test_a_prompt_id_rebuilds_the_same_prompt_in_any_process_order():
    a = ArithmeticTask(ArithmeticConfig(seed=3))
    b = ArithmeticTask(ArithmeticConfig(seed=3))
    forward = [a.prompt(i) for i in range(200)]
    backward = [b.prompt(i) for i in reversed(range(200))][::-1]
    assert forward == backward
    assert a.prompt(10**12) == b.prompt(10**12)  # any id, no state walked through


def test_training_seeds_give_different_streams_and_the_same_heldout_set():
    a = ArithmeticTask(ArithmeticConfig(seed=1))
    b = ArithmeticTask(ArithmeticConfig(seed=2))
    assert a.prompts(0, 50) != b.prompts(0, 50)
    assert a.heldout() == b.heldout()
    assert len(a.heldout()) == len(set(a.heldout())) == 500


def test_training_prompts_never_include_a_heldout_problem():
    task = ArithmeticTask(ArithmeticConfig(seed=0, heldout_size=2000, max_digits=2))
    held = set(task.heldout())
    assert not held & set(task.prompts(0, 5000))


def test_operands_have_one_to_three_digits_each_digit_count_about_equally_often():
    task = ArithmeticTask()
    held = [len(p.split("+")[0]) for p in task.heldout()]
    train = [len(p.split("+")[0]) for p in task.prompts(0, 3000)]
    for d in (1, 2, 3):
        assert abs(held.count(d) / len(held) - 1 / 3) < 0.05
        # one-digit pairs are few (100), and those in the held-out set are redrawn in training
        assert 0.25 < train.count(d) / len(train) < 0.40
    assert set(held) == set(train) == {1, 2, 3}


def test_the_reward_is_one_only_for_the_exact_answer():
    assert arithmetic_reward("12+345=", "357") == 1.0
    assert arithmetic_reward("12+345=", "3570") == 0.0
    assert arithmetic_reward("12+345=", "35") == 0.0
    assert arithmetic_reward("12+345=", " 357") == 0.0
    assert arithmetic_reward("999+999=", "1998") == 1.0


def test_max_new_tokens_fits_the_longest_answer_and_the_end_of_sequence_token():
    assert ArithmeticTask().max_new_tokens == len("1998") + 1
    assert ArithmeticTask(ArithmeticConfig(op="*")).max_new_tokens == len("998001") + 1
    assert ArithmeticTask(ArithmeticConfig(op="-")).max_new_tokens == len("-999") + 1


def test_bad_task_configs_name_the_field():
    with pytest.raises(ValueError, match="op"):
        ArithmeticConfig(op="/")
    with pytest.raises(ValueError, match="max_digits"):
        ArithmeticConfig(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="heldout_size"):
        ArithmeticTask(ArithmeticConfig(max_digits=1, heldout_size=50)).heldout()


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 48 + 24 = 72 clips.\n#### 72", "72"),
        ("the total is \\boxed{1,234}.", "1234"),
        ("First 3 apples, then 4. The answer is: $7.00", "7"),
        ("I computed 12 then 15 and finally 20.", "20"),
        ("#### -5", "-5"),
        ("no numbers here", None),
    ],
)
def test_the_gsm8k_style_extractor_finds_the_final_answer_in_any_text(text, answer):
    assert extract_answer(text) == answer


def test_answer_rewards_take_a_function_or_a_table_of_reference_answers():
    assert gsm8k_arithmetic_reward("12+345=", "Adding gives 357.") == 1.0
    assert gsm8k_arithmetic_reward("12+345=", "357 is wrong, #### 358") == 0.0
    table = answer_reward({"How many legs have 2 cats?": "8"})
    assert table("How many legs have 2 cats?", "Each has 4, so #### 8") == 1.0
    with pytest.raises(KeyError, match="no reference answer"):
        table("unknown", "8")


def test_a_reward_function_that_raises_is_named_in_the_error():
    def flaky_reward(prompt, completion):
        raise ZeroDivisionError("boom")

    with pytest.raises(RewardError, match=r"flaky_reward raised ZeroDivisionError: boom"):
        score(flaky_reward, "1+1=", "2")


@pytest.mark.parametrize("value", [math.nan, math.inf, "1", None, True])
def test_a_reward_that_is_not_a_finite_number_is_refused(value):
    with pytest.raises(RewardError, match="not a finite number"):
        score(lambda p, c: value, "1+1=", "2")


def test_solve_refuses_a_prompt_that_is_not_arithmetic():
    assert solve("7*8=") == "56"
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        solve("hello")
