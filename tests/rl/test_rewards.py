"""Reward functions of RL on prompt sets (`rewards.py`): veRL's GSM8K rule with its edge cases,
exact match, a user's module:function and file.py:function, and the one-line errors."""
import pytest

from ftrain.config import ConfigError
from ftrain.rl.rewards import extract_gsm8k_answer, gsm8k, load_reward


@pytest.mark.parametrize("text, strict, flexible", [
    ("so 6 * 7 = 42\n#### 42", "42", "42"),
    ("#### 1,234", "1234", "1,234"),             # strict drops commas, flexible keeps them
    ("#### -3", "-3", "-3"),
    ("####42", None, "42"),                      # strict needs one space after ####
    ("#### 41 then #### 42", "42", "42"),        # the last one
    ("#### $5", None, "5"),                       # a $ right after '#### ' is no number
    ("the answer is 42.", None, "42."),
    ("no number here", None, None),
    ("#### 42" + " pad" * 100, None, None),      # beyond the last 300 characters: not searched
    ("x" * 400 + "#### 7", "7", "7"),
    ("answer: . or 9", None, "9"),                # '.' alone is no number
])
def test_gsm8k_extraction_is_verls(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_scores():
    assert gsm8k("openai/gsm8k", "… #### 42", "42") == 1.0
    assert gsm8k("openai/gsm8k", "#### 41", "42") == 0.0
    assert gsm8k("openai/gsm8k", "42", "42") == 0.0                       # no ####: strict finds nothing
    assert gsm8k(None, "#### 42", 42) == 1.0                              # a numeric ground truth
    assert gsm8k(None, "#### 42.", "42") == 0.0                           # compared as text, as veRL
    assert gsm8k(None, "#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k(None, "no number", "42", format_score=0.1) == 0.0
    assert gsm8k(None, "it is 42", "42", method="flexible", score=2.0) == 2.0
    with pytest.raises(ValueError, match="strict or flexible"):
        extract_gsm8k_answer("#### 1", "loose")


def test_builtins_and_arguments_through_load_reward():
    exact = load_reward("exact")
    assert exact(None, "  Paris\n", "Paris", None) == 1.0 and exact(None, "paris", "Paris", None) == 0.0
    flexible = load_reward("gsm8k", {"method": "flexible", "format_score": 0.1})
    assert flexible("x", "7 + 5 = 12", "12", None) == 1.0 and flexible("x", "13", "12", None) == 0.1


def test_a_user_module_function_and_a_file_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(ground_truth in solution_str) + bonus + extra_info['index']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = load_reward("my_rewards:compute_score", {"bonus": 0.5})
    assert by_module("src", "it is 12", "12", {"index": 2}) == 3.5
    by_file = load_reward(f"{tmp_path}/my_rewards.py:compute_score")
    assert by_file("src", "it is 11", "12", {"index": 0}) == 0.0


@pytest.mark.parametrize("spec, args, expected", [
    ("nope", {}, "rl.reward: 'nope' is neither gsm8k / exact nor 'module:function'"),
    ("no_such_module_xyz:f", {}, "rl.reward: cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    ("ftrain.rl.rewards:no_such_function", {}, "rl.reward: 'ftrain.rl.rewards' has no function 'no_such_function'"),
    ("/no/such/file.py:f", {}, "rl.reward: /no/such/file.py: no such file"),
    ("gsm8k", {"colour": 1}, "rl.reward_args: gsm8k cannot be called as"),
    ("gsm8k", {"method": "loose"}, "rl.reward_args.method: 'loose': use strict or flexible"),
])
def test_bad_reward_specs_are_one_line(spec, args, expected):
    with pytest.raises(ConfigError) as e:
        load_reward(spec, args)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
