"""Tensor-, pipeline- and context-parallel operations on a rank's Megatron model stage, and the
RL parts built on them: rollouts (generation), the value head, vocabulary-parallel loss terms.

Used by `MegatronEngine.generate` / `_loss` on the live model, and by tests on a GPTModel stage
built on CPU. Every function that takes a `model` takes what Megatron's schedule takes: the DDP
wrapper, or a (possibly Float16Module-wrapped) GPTModel stage.

Context parallelism: the sequence is cut into 2*cp chunks and CP rank r keeps chunks r and
2*cp-1-r (Megatron's load-balanced layout): `cp_split`, and its differentiable inverse
`cp_gather`.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrain.data.training_batch import TrainingBatch

_MASKED_LOGIT = -1e9  # logit of a padded vocabulary column under RL: exp() is exactly 0, and
                      # unlike -inf it keeps p * log p finite (0) in the entropy


def cp_split(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of the sequence dim (1) of x [B, S, ...]: chunks cp_rank and
    2*cp-1-cp_rank of 2*cp equal chunks, concatenated -> [B, S/cp, ...]. Identity for cp=1."""
    if cp == 1:
        return x
    c = x.chunk(2 * cp, dim=1)
    return torch.cat([c[cp_rank], c[2 * cp - 1 - cp_rank]], dim=1)


def cp_gather(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """Inverse of `cp_split` over the CP group, differentiable: local [B, S/cp] -> [B, S].
    The backward sums the gradients of all CP ranks (so each rank's local part receives cp
    times the gradient of a loss that every rank computes identically)."""
    if cp == 1:
        return local
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(local.contiguous(), group=group)
    chunks: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def pipeline_forward(model, ids: torch.Tensor, on_output) -> list:
    """Forward-only pass of ids int64 [B, L] (on the model's device) through every pipeline
    stage: stage i > 0 receives the previous stage's hidden states [L, B, H] (in the config's
    pipeline_dtype) and sends its own to stage i + 1, by plain p2p over the PP group (an
    explicit pass instead of Megatron's schedule, which allocates on "cuda" and so cannot be
    tested on CPU; one micro-batch needs no schedule). Collective over the PP group (and inside
    the model, the TP group). On the last stage `on_output(logits float [B, L, V_pad/tp])`
    returns a dict, and the result is [that dict]; other stages return []. Positions are
    0..L-1 and the mask is Megatron's causal one (right padding after a row's last token does
    not change its earlier positions)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    group = ps.get_pipeline_model_parallel_group()
    if not ps.is_pipeline_first_stage():
        c = get_model_config(model)
        hidden = torch.empty(ids.shape[1], ids.shape[0], c.hidden_size, dtype=c.pipeline_dtype, device=ids.device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
        get_attr_wrapped_model(model, "set_input_tensor")(hidden)
    out = model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
        return []
    return [on_output(out)]


def _broadcast_from_last_stage(x: torch.Tensor) -> torch.Tensor:
    """x (meaningful on the last pipeline stage, same shape and dtype everywhere) broadcast in
    place over the PP group: one collective per call on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(x, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return x


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def sampling_logits_fn(model, vocab_size: int, temperature: float, on_round=None):
    """The `logits_fn` of `rl.sample` for this rank's Megatron model stage.

    Each call (one sampling round) runs the prefix through all pipeline stages
    (`pipeline_forward`); the last stage takes each row's logits at its last token
    (index mask.sum(-1) - 1: the only position `rl.sample` reads), all-gathers the vocabulary
    shards over the TP group, drops the padded columns (>= `vocab_size`) and divides by
    `temperature`; the result [B, V] float32 is broadcast over the PP group. So every TP and PP
    rank of a model replica sees bitwise the same logits, and `rl.sample` (same per-row
    generators) draws the same tokens there, which the first stage feeds to the next round. Every
    stage makes the same collectives per round: its p2p receive / send, one broadcast.

    Returns fn(ids int64 [B, L], mask int64 [B, L]) -> float32 [B, L, V] on the CPU: the last
    positions' logits expanded along L (a view, no copy). Only the positions `rl.sample` reads
    (each row's last token) hold that row's logits; pass it to `rl.sample` only.
    `on_round()` is called once per round (progress counting)."""
    from megatron.core import parallel_state as ps

    device = _model_device(model)

    def last_token_logits(logits, last):
        local = logits[torch.arange(len(last), device=device), last].float().contiguous()  # [B, V_pad/tp]
        return {"logits": gather_vocab(local)[:, :vocab_size] / temperature}

    def logits_fn(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        last = (mask.sum(-1) - 1).to(device)
        out = pipeline_forward(model, ids.to(device), functools.partial(last_token_logits, last=last))
        x = out[0]["logits"] if ps.is_pipeline_last_stage() else \
            torch.empty(ids.shape[0], vocab_size, device=device)
        x = _broadcast_from_last_stage(x).cpu()
        if on_round is not None:
            on_round()
        return x[:, None].expand(ids.shape[0], ids.shape[1], vocab_size)

    return logits_fn


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """All-gather vocabulary shards [..., V_pad/tp] over the TP group -> [..., V_pad] (rank
    order = vocabulary order, as Megatron's VocabParallelEmbedding / output layer split it).
    No gradient."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits float [..., V_pad/tp] (this TP rank's shard) with the padded vocabulary columns
    (global index >= `vocab_size`) set to `_MASKED_LOGIT`: RL trains the distribution over the
    real vocabulary, the one `sampling_logits_fn` samples from. Returns a new tensor."""
    from megatron.core import parallel_state as ps

    n = logits.shape[-1]
    col = ps.get_tensor_model_parallel_rank() * n + torch.arange(n, device=logits.device)
    return logits.masked_fill(col >= vocab_size, _MASKED_LOGIT)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`ppo.token_entropy` of vocabulary-parallel logits float32 [B, S, V/tp] (this TP rank's
    shard), without gathering the vocabulary: with m the max over the whole vocabulary
    (all-reduced, no gradient: H does not depend on the shift), z = logits - m,
        H = log sum_v exp(z_v) - sum_v exp(z_v) z_v / sum_v exp(z_v),
    the two sums all-reduced over the TP group with Megatron's reduce_from_tensor_model_parallel_region
    (backward: identity, so each rank's shard gets the gradient of the full-vocabulary entropy),
    as Megatron's vocab_parallel_cross_entropy does for the log-sum-exp. Returns float32 [B, S],
    column t = H(p(. | prefix before t)), column 0 = 0, equal on every TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits[:, :-1].float() - m[:, :-1]
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(-1))
    ez = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
    return F.pad(total.log() - ez / total, (1, 0))


def add_value_head(model) -> None:
    """Give a last-stage GPTModel `model` a value head for GAE: `model.value_head`, a
    zero-initialised Linear(hidden, 1) in the model's dtype, registered as a submodule so that
    Megatron DDP, the optimizer, `sharded_state_dict` and the engine's state copies include it,
    and a forward hook on `model.decoder.final_layernorm` that keeps the last forward's final
    hidden states [L, B, H] (after the final norm, the output layer's input) for `token_values`.
    A hook rather than a second forward: GPTModel.forward returns logits only, and the hook
    works unchanged under DDP / Float16Module and the pipeline schedule."""
    c = model.config
    head = torch.nn.Linear(c.hidden_size, 1, dtype=c.params_dtype, device=_model_device(model))
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.value_head = head

    def keep_hidden(module, args, output):
        model.__dict__["_final_hidden"] = output

    model.decoder.final_layernorm.register_forward_hook(keep_hidden)


def token_values(model) -> torch.Tensor:
    """Values float32 [B, L] of the last forward of `model` (a GPTModel stage with
    `add_value_head`; the last stage): `align_values(value_head(final hidden))`. Consumes the
    kept hidden states. Raises KeyError if no forward ran since the last call."""
    hidden = model.__dict__.pop("_final_hidden")
    return align_values(model.value_head(hidden))


def align_values(v: torch.Tensor) -> torch.Tensor:
    """Value head output [L, B, 1] (sequence-first, Megatron's layout) -> float32 [B, L] aligned
    like `rl.PolicyValue`: column t = V(prefix before token t) = head output at t - 1, column 0 = 0."""
    return F.pad(v.squeeze(-1).t()[:, :-1].float(), (1, 0))


@torch.no_grad()
def sample_rollouts(model, prompts: TrainingBatch, seeds: list[int], rl_cfg, vocab_size: int,
                    with_values: bool, stop_ids: tuple[int, ...], pad_id: int, on_round=None) -> dict:
    """`rl.sample` of `prompts` (right-padded int64 [B, S] input_ids / attention_mask, CPU) on
    this rank's Megatron model stage (`sampling_logits_fn`; temperature and top-p of `rl_cfg`),
    row b drawing from a generator seeded with seeds[b], stopping at any of `stop_ids`, padded
    with `pad_id`. Collective over the model-parallel
    (TP x PP) group of the replica: every rank returns the same result. With `with_values`,
    one more forward of the sampled sequences gives the value head's estimates (`token_values`,
    last stage, broadcast over the PP group).

    Returns `rl.sample`'s dict of CPU [B, S] tensors plus `values` (float32 [B, S] or None)."""
    from ftrain.rl.rollouts import sample

    out = sample(sampling_logits_fn(model, vocab_size, rl_cfg.temperature, on_round),
                 prompts.input_ids, prompts.attention_mask, seeds, rl_cfg.max_new_tokens, stop_ids, pad_id,
                 temperature=1.0, top_p=rl_cfg.top_p)
    out["values"] = None
    if with_values:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        device = _model_device(model)
        ids = out["input_ids"].to(device)
        res = pipeline_forward(model, ids, lambda logits: {"values": token_values(unwrap_model(model))})
        v = res[0]["values"] if ps.is_pipeline_last_stage() else torch.empty(ids.shape, device=device)
        out["values"] = _broadcast_from_last_stage(v.contiguous()).cpu()
    return out

