"""Reward functions of RL on prompt sets: a completion's text scored against the prompt's answer.

Every reward has veRL's `compute_score` signature:

    reward(data_source: str | None, solution_str: str, ground_truth, extra_info: dict | None) -> float

`solution_str` is the completion alone (the prompt not included), decoded without special
tokens; `ground_truth` is the row's `reward_model.ground_truth` as the file holds it.

- `gsm8k`: veRL's GSM8K rule (`verl/utils/reward_score/gsm8k.py`): only the last 300 characters
  are searched; `strict` takes the last `#### <number>` ("#### " with one space, then digits,
  '-', '.', ','; commas and '$' dropped), `flexible` the last number anywhere (commas kept);
  `score` when it equals str(ground_truth), `format_score` when a number was found but is
  another, 0 when none was.
- `exact`: `score` when the completion, stripped of surrounding whitespace, equals
  str(ground_truth) stripped, else 0.
- `module:function` (or `path/to/file.py:function`, veRL's `custom_reward_function.path` and
  `.name`): the user's own, called with `rl.reward_args` as keyword arguments.

Replay needs a deterministic reward: a step re-run after a recovery samples the same completions
and must score them the same, or the run after recovery differs from the run without failure.
A reward that is not (an LLM judge, a sandbox with timeouts) runs with `rl.record_rewards: true`,
which stores the rewards of each committed step and reuses them when the step is replayed.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Callable

from ftrain.config import ConfigError

RewardFn = Callable[..., float]

CLIP_CHARS = 300  # veRL: only the end of a long completion is searched (regexes on long text are slow)
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer veRL's GSM8K rule reads from `solution_str` (see the module docstring), or
    None. Raises ValueError for a method other than strict / flexible."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: use strict or flexible")
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = [n for n in _NUMBER.findall(text) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def gsm8k(data_source, solution_str: str, ground_truth, extra_info=None, method: str = "strict",
          format_score: float = 0.0, score: float = 1.0) -> float:
    """veRL's GSM8K reward: `score` if the extracted answer equals str(ground_truth),
    `format_score` if another was extracted, 0.0 if none."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)


def exact(data_source, solution_str: str, ground_truth, extra_info=None, score: float = 1.0) -> float:
    """`score` if the stripped completion equals str(ground_truth) stripped, else 0.0."""
    return float(score) if solution_str.strip() == str(ground_truth).strip() else 0.0


BUILTIN = {"gsm8k": gsm8k, "exact": exact}


def _import_function(spec: str) -> RewardFn:
    """The function of "module:function" or "file.py:function". Raises ConfigError."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"rl.reward: {spec!r} is neither {' / '.join(BUILTIN)} nor 'module:function' "
                          "(or 'path/to/file.py:function')")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ConfigError(f"rl.reward: {where}: no such file")
            module_spec = importlib.util.spec_from_file_location(f"reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module: any error it raises at import
        raise ConfigError(f"rl.reward: cannot import {where!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward: {where!r} has no function {name!r}")
    return fn


def load_reward(spec: str, args: dict | None = None) -> RewardFn:
    """The reward `spec` names (gsm8k, exact, module:function, file.py:function) with `args`
    bound as keyword arguments: a function (data_source, solution_str, ground_truth, extra_info)
    -> float. Raises ConfigError (naming rl.reward / rl.reward_args) for an unknown name, a
    module that does not import, or arguments the function does not take."""
    fn = BUILTIN.get(spec) or _import_function(spec)
    args = dict(args or {})
    try:
        inspect.signature(fn).bind("data_source", "solution", "truth", None, **args)
    except TypeError as e:
        raise ConfigError(f"rl.reward_args: {spec} cannot be called as (data_source, solution_str, "
                          f"ground_truth, extra_info, **{args}): {e}") from None
    except ValueError:  # no signature to inspect (a builtin): called as is
        pass
    if fn is gsm8k and args.get("method", "strict") not in ("strict", "flexible"):
        raise ConfigError(f"rl.reward_args.method: {args['method']!r}: use strict or flexible")

    def reward(data_source, solution_str, ground_truth, extra_info) -> float:
        return float(fn(data_source, solution_str, ground_truth, extra_info, **args))

    return reward
