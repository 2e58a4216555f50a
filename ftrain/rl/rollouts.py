"""On-policy RL on real experience: tasks with verifiable rewards, batched sampling, and the
driver's side of a rollout (prompts in, advantages out).

One RL step (driven by `trainer.Trainer` when `rl.enabled`):
    prompts (pure function of seed, step)  -> `MegatronActor.generate` on every DP replica
    -> completions + values (per row)      -> rewards (the task's exact reward, on the driver)
    -> advantages (GRPO or GAE, ppo.py)    -> `train_step` (PPO updates over mini-batches)

Determinism: sampling row i of step s draws its randomness from its own generator seeded with
(train.seed, s, i) only (`row_seed`), so the completions are a pure function of the policy
weights and (seed, step, global row): the same on a re-run after recovery, after a checkpoint
resume, and at any DP size or on any actor.

Pluggable tasks: `register_task(name, factory)`; `rl.task` names the factory and
`rl.task_args` are its keyword arguments; `rl.task_module` names a module imported first (where
a user's `register_task` calls live). A `Task` is a tokenizer, a prompt source
(`prompt(rng) -> Prompt`) and a reward function (`reward(prompt, response_ids) -> float`).
With data.kind=prompts the task is a prompt set (`prompt_set.py`, veRL's layout) scored by
`rl.reward` (`rewards.py`); its prompts of step s are the rows the training data's address
(`data.Data.addresses`) gives for s, and its pad / stop ids are the tokenizer's.
`check_task(cfg)` builds the configured task and checks it against the config (ConfigError).

Rewards must be deterministic: a replayed step scores its completions again. With
`rl.record_rewards` the rewards of every committed step are stored (`RecordedRewards`) and a
replay of the same completions uses them instead.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ftrain.config import Config, ConfigError, require
from ftrain.data.training_batch import TrainingBatch

# -- tokenizer and tasks ---------------------------------------------------------------------

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # every task's tokenizer: the engine stops at EOS_ID, pads with PAD_ID


class Tokenizer:
    """A tokenizer over a fixed list of symbols (one token each), built from a task's own
    vocabulary. Ids: 0 = <pad>, 1 = <bos>, 2 = <eos>, then `symbols` in order."""

    def __init__(self, symbols: list[str]):
        self.vocab = [PAD, BOS, EOS] + [s for s in symbols if s not in (PAD, BOS, EOS)]
        self.ids = {s: i for i, s in enumerate(self.vocab)}
        if len(self.ids) != len(self.vocab):
            raise ValueError(f"duplicate symbols in {symbols}")
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, symbols) -> list[int]:
        """Token ids of an iterable of symbols (a str is read one character per symbol)."""
        return [self.ids[s] for s in symbols]

    def decode(self, ids) -> list[str]:
        return [self.vocab[int(i)] for i in ids]


@dataclass
class Prompt:
    """One prompt: its token ids and whatever the reward needs (a prompt set's row: its
    ground truth, data_source and extra_info)."""
    tokens: list[int]
    answer: Any = None
    data_source: str | None = None
    extra_info: Any = None


@dataclass
class Task:
    """A verifiable task: `prompt(rng)` draws one prompt from a `random.Random`; `reward(prompt,
    response)` scores a completion (token ids after the prompt, up to and including the stop
    token when it was generated) exactly; `max_prompt_len` bounds len(Prompt.tokens).
    Generation pads with `pad_id` and stops at any of `stop_ids` (the tokenizer's). A prompt-set
    task has `prompt_set` (a `prompt_set.PromptSet`) instead of `prompt`."""
    tokenizer: Any
    prompt: Callable[[random.Random], Prompt] | None
    reward: Callable[[Prompt, list[int]], float]
    max_prompt_len: int
    info: dict = field(default_factory=dict)
    pad_id: int = PAD_ID
    stop_ids: tuple[int, ...] = (EOS_ID,)
    prompt_set: Any = None


DIGIT_OPS = ("copy", "reverse", "add")


def digit_task(op: str = "reverse", digits: int = 3, partial: bool = True) -> Task:
    """Digit-string tasks generated on the fly: `copy` ("<bos> 1 2 3 =" -> "1 2 3 <eos>"),
    `reverse` (-> "3 2 1 <eos>") or `add` ("<bos> 4 7 + 5 8 =" -> "1 0 5 <eos>"), with
    `digits` digits per operand. Reward: the fraction of target positions (the answer digits and
    <eos>) the response gets right position by position (`partial`), or 1.0 for an exact match
    and 0.0 otherwise."""
    if op not in DIGIT_OPS:
        raise ValueError(f"rl.task_args.op={op!r} is not one of {list(DIGIT_OPS)}")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"rl.task_args.digits={digits!r} must be an int >= 1")
    tok = Tokenizer(list("0123456789+="))

    def prompt(rng: random.Random) -> Prompt:
        a = "".join(rng.choice("0123456789") for _ in range(digits))
        if op == "add":
            b = "".join(rng.choice("0123456789") for _ in range(digits))
            return Prompt([tok.bos_id] + tok.encode(a + "+" + b + "="), str(int(a) + int(b)))
        return Prompt([tok.bos_id] + tok.encode(a + "="), a if op == "copy" else a[::-1])

    def reward(p: Prompt, response: list[int]) -> float:
        target = tok.encode(p.answer) + [tok.eos_id]
        hits = sum(1 for i, t in enumerate(target) if i < len(response) and response[i] == t)
        return hits / len(target) if partial else float(hits == len(target) == len(response))

    answer_len = digits + 1 if op == "add" else digits
    prompt_len = 2 * digits + 3 if op == "add" else digits + 2
    return Task(tok, prompt, reward, prompt_len, {"answer_len": answer_len + 1})


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Register a task factory under `name` (config `rl.task`); `rl.task_args` are passed to it
    as keyword arguments. Raises ValueError if the name is taken by another factory."""
    if _TASKS.get(name, factory) is not factory:
        raise ValueError(f"task {name!r} is already registered to {_TASKS[name]!r}")
    _TASKS[name] = factory


def make_task(name: str, args: dict | None = None, module: str | None = None) -> Task:
    """Import `module` (if given; it may call `register_task`), then build task `name` with
    `args`. Raises KeyError naming the registered tasks; the factory's own errors pass through."""
    if module:
        importlib.import_module(module)
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(_TASKS)}")
    return _TASKS[name](**(args or {}))


def prompt_set_task(cfg: Config) -> Task:
    """The task of a prompt set (data.kind=prompts): the rows of data.path (`prompt_set.
    open_prompt_set`, every row checked), scored by rl.reward with rl.reward_args
    (`rewards.load_reward`) on the completion decoded without special tokens. Raises
    ConfigError."""
    from ftrain.data.prompt_set import open_prompt_set
    from ftrain.rl.rewards import load_reward

    score = load_reward(cfg.rl.reward, cfg.rl.reward_args)
    ps = open_prompt_set(cfg)
    tok = ps.tokenizer

    def reward(p: Prompt, response: list[int]) -> float:
        return score(p.data_source, tok.decode(response, skip_special_tokens=True), p.answer, p.extra_info)

    return Task(tok, None, reward, ps.max_len, pad_id=ps.pad_id, stop_ids=ps.stop_ids, prompt_set=ps)


def check_task(cfg: Config) -> Task:
    """The task of `rl.task` / `rl.task_args` / `rl.task_module` (or, with data.kind=prompts,
    `prompt_set_task`), built and checked against the model and sequence sizes (its tokens fit
    model.vocab_size; its longest prompt plus rl.max_new_tokens fits train.seq_len). Raises
    ConfigError naming the field; the driver calls it before Ray starts."""
    r, t, m = cfg.rl, cfg.train, cfg.model
    if cfg.data.kind == "prompts":
        return prompt_set_task(cfg)
    try:
        task = make_task(r.task, r.task_args, r.task_module)
    except KeyError as e:
        raise ConfigError(f"rl.task: {e.args[0]}; register it with rl.register_task or set "
                          f"rl.task_module to the module that does") from None
    except ImportError as e:
        raise ConfigError(f"rl.task_module: cannot import {r.task_module!r}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rl.task_args: {e}") from None
    require(len(task.tokenizer) <= m.vocab_size, "model.vocab_size",
            f"{m.vocab_size} is smaller than the {len(task.tokenizer)} tokens of task {r.task!r}")
    require(task.max_prompt_len + r.max_new_tokens <= t.seq_len, "train.seq_len",
            f"{t.seq_len} cannot hold a prompt of up to {task.max_prompt_len} tokens plus "
            f"rl.max_new_tokens={r.max_new_tokens}; raise train.seq_len or lower rl.max_new_tokens")
    return task


for _op in DIGIT_OPS:
    register_task(_op, lambda _op=_op, **kw: digit_task(op=_op, **kw))


# -- sampling --------------------------------------------------------------------------------

def row_seed(seed: int, step: int, row: int) -> int:
    """A 63-bit generator seed that is a pure function of (seed, step, global row)."""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def top_p_filter(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """Nucleus filtering (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration",
    arXiv:1904.09751): keep the smallest prefix of tokens sorted by probability whose mass
    reaches `top_p` (at least one), renormalised.

    Args: probs float32 [B, V]. Returns (sorted_probs [B, V] renormalised with dropped tokens 0,
    order int64 [B, V]: token id of each sorted column)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    return sorted_p / sorted_p.sum(-1, keepdim=True), order


@torch.no_grad()
def sample(logits_fn: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor, attention_mask: Tensor,
           seeds: list[int], max_new_tokens: int, stop_ids, pad_id: int,
           temperature: float = 1.0, top_p: float = 1.0, on_token=None) -> dict[str, Tensor]:
    """Batched autoregressive sampling with temperature and top-p, one generator per row.

    Prompts are right-padded: row b's prompt is input_ids[b, :n_b] with attention_mask 1 there.
    Each round runs the model on the prefix up to the longest row (no KV cache: the tiny CPU
    models need none, and a full forward keeps every row's numbers independent of when others
    stopped) and appends one token to every row still running at its own length. A row stops at
    a token of `stop_ids` (an id or a sequence of ids: the tokenizer's EOS and turn ends), after
    `max_new_tokens`, or at the end of the buffer (S columns). A token is drawn by
    inverse-CDF from the row's own generator (`seeds[b]`): one uniform per row and round, so
    the draw depends on no other row.

    Args:
        logits_fn: (input_ids int64 [B, L], attention_mask int64 [B, L]) -> float [B, L, V].
        input_ids, attention_mask: int64 [B, S]; S bounds prompt + completion.
        seeds: B generator seeds.
        on_token: called once per round (progress counting).

    Returns dict of [B, S] tensors: input_ids (prompt + completion, pad_id after), int64;
    attention_mask int64 (1 on prompt + completion); loss_mask float32 (1 on completion tokens);
    log_probs float32 (log-prob of each sampled token under the temperature-scaled policy,
    before top-p; 0 elsewhere).
    """
    ids, mask = input_ids.clone(), attention_mask.clone()
    B, S = ids.shape
    if len(seeds) != B:
        raise ValueError(f"{len(seeds)} seeds for {B} rows")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    stops = torch.as_tensor(stop_ids, dtype=torch.long).reshape(-1)
    lengths = mask.sum(-1)  # [B]
    if (lengths < 1).any() or (mask != (torch.arange(S) < lengths[:, None]).long()).any():
        raise ValueError("prompts must be right-padded with at least one token each")
    loss_mask = torch.zeros(B, S)
    log_probs = torch.zeros(B, S)
    running = lengths < S
    rows = torch.arange(B)
    for _ in range(max_new_tokens):
        if not running.any():
            break
        L = int(lengths.max())
        logits = logits_fn(ids[:, :L], mask[:, :L])[rows, lengths - 1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [B, V]
        sorted_p, order = top_p_filter(logp.exp(), top_p)
        cdf = sorted_p.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=g) for g in gens]) * cdf[:, -1]
        col = torch.searchsorted(cdf, u[:, None]).clamp(max=cdf.shape[1] - 1)
        col = torch.where(sorted_p.gather(1, col) > 0, col, torch.zeros_like(col))  # never a dropped token
        token = order.gather(1, col).squeeze(1)
        at = lengths.clamp(max=S - 1)
        r = rows[running]
        ids[r, at[r]] = token[r]
        mask[r, at[r]] = 1
        loss_mask[r, at[r]] = 1.0
        log_probs[r, at[r]] = logp[r, token[r]]
        lengths = lengths + running.long()
        running = running & ~torch.isin(token, stops) & (lengths < S)
        if on_token is not None:
            on_token()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "log_probs": log_probs}


class PolicyValue(nn.Module):
    """The policy LM and, for GAE, a scalar value head on its last hidden state (shared trunk).

    forward(input_ids int64 [B, S], attention_mask int64 [B, S]) -> (logits float [B, S, V],
    values float32 [B, S] or None); values[:, t] = V(input_ids[:, :t]), the value of the state
    before token t (aligned like `ppo.token_log_probs`), column 0 = 0."""

    def __init__(self, lm: nn.Module, value_head: nn.Linear | None = None):
        super().__init__()
        self.lm, self.value_head = lm, value_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        if self.value_head is None:
            return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits, None
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm.get_output_embeddings()(hidden)
        values = self.value_head(hidden[:, :-1]).squeeze(-1).float()
        return logits, nn.functional.pad(values, (1, 0))


# -- the driver's side of a rollout ---------------------------------------------------------

def unstride(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of `MeshDispatch.split`'s interleaving: parts[d][k] [b, ...] is global row
    k * dp + d. Returns dict of [b * dp, ...] tensors in global row order."""
    return {k: torch.stack([p[k] for p in parts], dim=1).reshape(-1, *parts[0][k].shape[1:])
            for k in parts[0] if parts[0][k] is not None}


class RecordedRewards:
    """The rewards of committed steps (`rl.record_rewards`), in a JSON-lines file: one line
    {step, digest, rewards} per committed step, appended and fsynced when the step commits.
    `digest` names what was scored (`rollout_digest`): a replay uses the recorded rewards only
    when it scored the same thing."""

    def __init__(self, path: Path):
        self.path = path
        self.steps: dict[int, tuple[str, list[float]]] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.steps[rec["step"]] = (rec["digest"], rec["rewards"])

    def get(self, step: int, digest: str) -> list[float] | None:
        """The recorded rewards of `step` if they scored `digest`, else None."""
        rec = self.steps.get(step)
        return rec[1] if rec is not None and rec[0] == digest else None

    def record(self, step: int, digest: str, rewards: list[float]) -> None:
        """Store the rewards of committed `step` (replacing another record of it)."""
        if self.steps.get(step) == (digest, rewards):
            return
        self.steps[step] = (digest, rewards)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "digest": digest, "rewards": rewards}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def rollout_digest(prompts: list[Prompt], ids: Tensor, mask: Tensor) -> str:
    """SHA-256 of what a step's rewards score: every row's tokens and completion mask, and each
    prompt's answer, data source and extra info."""
    h = hashlib.sha256(ids.numpy().tobytes())
    h.update(mask.numpy().tobytes())
    h.update(repr([(p.answer, p.data_source, p.extra_info) for p in prompts]).encode())
    return h.hexdigest()


class Rollouts:
    """Prompts of each step and the experience built from the sampled completions.

    Step s uses P = `train.global_batch_size / rl.group_size` prompts; rows [j*G, (j+1)*G) are
    prompt j's G samples. Prompt j is drawn from `random.Random(row_seed(seed, s, -1 - j))`,
    or, for a prompt set, is the row the training data's address gives for sample
    (s - 1) * P + j (`data.Data.addresses` over the set's rows: a seeded permutation per
    epoch, data.seed else train.seed)."""

    def __init__(self, cfg):
        from ftrain.data.dataset import Data

        self.cfg, self.rl = cfg, cfg.rl
        self.task = check_task(cfg)
        self.tok = self.task.tokenizer
        self.order = None
        if self.task.prompt_set is not None:
            seed = cfg.train.seed if cfg.data.seed is None else cfg.data.seed
            self.order = Data([(1.0, self.task.prompt_set)], seed, cfg.train.global_batch_size // cfg.rl.group_size,
                              names=[cfg.data.path])
        self.recorded = RecordedRewards(Path(cfg.run_dir) / "recorded_rewards.jsonl") if cfg.rl.record_rewards else None
        self._scored: tuple[int, str, list[float]] | None = None  # (step, digest, rewards) in flight

    def prompts(self, step: int) -> list[Prompt]:
        t, g = self.cfg.train, self.rl.group_size
        if self.order is None:
            return [self.task.prompt(random.Random(row_seed(t.seed, step, -1 - j)))
                    for j in range(t.global_batch_size // g)]
        ps = self.task.prompt_set
        return [Prompt(ps.tokens[w], ps.ground_truths[w], ps.data_sources[w], ps.extra_infos[w])
                for _, _, _, w in self.order.addresses(step)]

    def prompt_batch(self, prompts: list[Prompt]) -> TrainingBatch:
        """Each prompt repeated `group_size` times, right-padded with the task's pad id to
        train.seq_len: input_ids / attention_mask int64 [B, S], the mask 1 on each prompt's own
        length (not `ids != pad`: a pad id may equal EOS or occur in a prompt); loss_mask and
        advantages are zeros (filled by the rollout)."""
        S, g = self.cfg.train.seq_len, self.rl.group_size
        ids = torch.full((len(prompts) * g, S), self.task.pad_id, dtype=torch.long)
        lengths = torch.tensor([len(p.tokens) for p in prompts]).repeat_interleave(g)
        for j, p in enumerate(prompts):
            ids[j * g:(j + 1) * g, :len(p.tokens)] = torch.tensor(p.tokens)
        mask = (torch.arange(S) < lengths[:, None]).long()
        return TrainingBatch(ids, mask, torch.zeros(ids.shape), torch.zeros(ids.shape))

    def score(self, step: int, prompts: list[Prompt], ids: Tensor, mask: Tensor) -> Tensor:
        """float32 [B]: each row's reward, the task's reward of its completion (the tokens under
        `mask`); with rl.record_rewards the recorded rewards of `step` when they scored the
        same rollout (`RecordedRewards`)."""
        g = self.rl.group_size
        digest = rollout_digest(prompts, ids, mask) if self.recorded is not None else ""
        rewards = self.recorded.get(step, digest) if self.recorded is not None else None
        if rewards is None:
            rewards = [float(self.task.reward(prompts[i // g], ids[i][mask[i].bool()].tolist()))
                       for i in range(mask.shape[0])]
        self._scored = (step, digest, rewards)
        return torch.tensor(rewards)

    def commit(self, step: int) -> None:
        """Step `step` is committed: with rl.record_rewards, store the rewards it used."""
        if self.recorded is not None and self._scored is not None and self._scored[0] == step:
            self.recorded.record(*self._scored)

    def experience(self, step: int, prompts: list[Prompt], parts: list[dict]) -> tuple[TrainingBatch, dict]:
        """Rewards (`score`) and advantages of step `step`'s rollout. `parts`:
        `MegatronActor.generate` results, one per DP replica in dp order. Returns the
        TrainingBatch for `train_step` (old_log_probs None: recomputed by the engine) and
        stats: reward (mean), exact (fraction of samples with reward 1), response_len (mean
        tokens)."""
        rl = self.rl
        out = unstride(parts)
        mask = out["loss_mask"]
        g = rl.group_size
        scores = self.score(step, prompts, out["input_ids"], mask)
        last = (mask * torch.arange(mask.shape[1])).argmax(-1)  # index of each row's last response token
        returns = old_values = None
        if rl.advantage == "grpo":
            from ftrain.objectives.ppo import group_advantages
            advantages = group_advantages(scores, g, rl.norm_std)[:, None] * mask
        else:
            from ftrain.objectives.ppo import gae_advantages, whiten
            rewards = torch.zeros_like(mask)
            rewards[torch.arange(len(scores)), last] = scores
            old_values = out["values"] * mask
            advantages, returns = gae_advantages(rewards, old_values, mask, rl.gamma, rl.lam)
            advantages = whiten(advantages, mask)
        batch = TrainingBatch(out["input_ids"], out["attention_mask"], mask, advantages.float(),
                              returns=returns, old_values=old_values)
        stats = {"reward": scores.mean().item(), "exact": (scores == 1).float().mean().item(),
                 "response_len": mask.sum(-1).mean().item()}
        return batch, stats
