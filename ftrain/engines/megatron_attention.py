"""`SDPAttention`: Megatron-Core's core attention computed by torch's
`scaled_dot_product_attention` (flash / cuDNN / memory-efficient kernels), for the local layer
spec, which Megatron builds when Transformer Engine is absent.

Why: the local spec's `DotProductAttention` materialises the [b, heads, s, s] scores
(baddbmm, softmax, bmm): memory quadratic in the sequence and about half the speed of a fused
kernel at s = 2048. This class keeps Megatron's module (its parameters, state dict, TP split
and config checks) and replaces only the computation, so checkpoints and layouts are unchanged.

Context parallelism (`context_parallel_attention`), which Megatron's local attention refuses:
each CP rank holds chunks r and 2cp-1-r of the sequence cut into 2cp equal chunks (Megatron's
load-balanced layout, `get_batch_on_this_cp_rank`; RoPE already takes each rank's positions
from it). Keys and values are all-gathered over the CP group (one collective per layer; its
backward reduce-scatters their gradients: Megatron's `gather_from_sequence_parallel_region`),
and each local query chunk attends causally to the keys up to its own end (a lower-right
aligned causal mask: flash / memory-efficient kernels, no mask tensor on the GPU).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def _causal_lower_right(q, k, v, scale: float, dropout: float) -> torch.Tensor:
    """SDPA of q [b, h, sq, d] over k / v [b, h, sk, d], sq <= sk, query i attending to keys
    j <= i + sk - sq (the queries are the last sq positions of the keys' span)."""
    sq, sk = q.shape[2], k.shape[2]
    if q.is_cuda:  # dispatched to the flash / memory-efficient kernels' own causal variant
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(sq, sk)
    else:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)


def context_parallel_attention(query, key, value, cp_group, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    query [s, b, h, d], key / value [s, b, g, d] (Megatron's sequence-first layout; g divides
    h: grouped-query attention): this rank's part of a sequence of S = cp * s tokens cut into
    2cp chunks of c = s / 2, chunks r and 2cp-1-r concatenated, r = the rank in `cp_group`.
    Returns the context [s, b, h, d] of the same positions, differentiable in query, key and
    value (the gradients of key / value from every rank's queries are summed on their owner).
    Collective over `cp_group` (forward and backward): every rank must call it."""
    cp, r = cp_group.size(), cp_group.rank()
    s, b, g, d = key.shape
    h, c = query.shape[2], s // 2
    kv = gather_from_sequence_parallel_region(torch.cat((key, value), dim=-1), group=cp_group)  # rank-major
    # global chunk m sits at slot 2m (rank m's first half) or 2(2cp-1-m)+1 (rank 2cp-1-m's second)
    order = [2 * m if m < cp else 2 * (2 * cp - 1 - m) + 1 for m in range(2 * cp)]
    kv = kv.view(2 * cp, c, b, g, 2 * d)[order].view(2 * cp * c, b, g, 2 * d)
    k, v = (x.permute(1, 2, 0, 3) for x in (kv[..., :d], kv[..., d:]))      # [b, g, S, d]
    if g != h:  # the lower-right causal kernels take equal head counts
        k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    q = query.permute(1, 2, 0, 3)                                            # [b, h, s, d]
    out = [_causal_lower_right(q[:, :, i * c:(i + 1) * c], k[:, :, :(m + 1) * c], v[:, :, :(m + 1) * c],
                               scale, dropout)
           for i, m in enumerate((r, 2 * cp - 1 - r))]
    return torch.cat(out, dim=2).permute(2, 0, 1, 3)


class SDPAttention(DotProductAttention):
    """`DotProductAttention` with the same contract: query [sq, b, heads/tp, d], key / value
    [sk, b, groups/tp, d] -> context [sq, b, heads/tp * d]; causal (Megatron's `causal` mask
    type with no mask tensor) or an explicit boolean `attention_mask` (True = masked, Megatron's
    convention); grouped-query attention by the kernel's `enable_gqa`; the softmax scale of the
    config (1/sqrt(d), or `softmax_scale`; query-key layer scaling folds back to the same);
    attention dropout from the config under Megatron's CUDA RNG tracker.

    Falls back to the parent's computation for what SDPA does not express: sliding-window
    attention and softmax types other than 'vanilla' (`uses_sdpa` is False then).

    With config.context_parallel_size > 1: causal attention only, over the CP group of the
    `pg_collection` Megatron's attention passes in (`context_parallel_attention`); raises
    ValueError at construction for a model it cannot serve so (sliding window, softmax type)
    and at forward for an explicit mask tensor."""

    def __init__(self, config, *args, **kwargs):
        # The parent refuses cp > 1 only because its own computation has none: it is built
        # from a copy with cp = 1 and the real config is kept.
        parent_config = config
        if config.context_parallel_size > 1:
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(parent_config, *args, **kwargs)
        self.config = config
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        # apply_query_key_layer_scaling divides the scale by the layer number and the softmax
        # multiplies it back (an fp16 overflow guard): the product is the scale to use.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        self.uses_sdpa = self.softmax_offset is None and self.scale_mask_softmax.window_size is None
        if self.cp_group is not None and not self.uses_sdpa:
            raise ValueError("parallel.cp > 1 without Transformer Engine needs plain causal attention "
                             "(no sliding window, softmax_type 'vanilla'); install transformer_engine or set parallel.cp=1")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self.uses_sdpa:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        assert packed_seq_params is None and attention_bias is None, \
            "packed sequences and attention bias need Transformer Engine's attention"
        # as Megatron's softmax: no mask for a single query position
        causal = (attention_mask is None and query.shape[0] > 1
                  and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal)
        if self.cp_group is not None and not causal:
            raise ValueError("context parallelism without Transformer Engine supports the causal mask "
                             "type only (no attention_mask tensor)")
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(query, key, value, attention_mask, causal, dropout)
        else:
            out = self._attend(query, key, value, attention_mask, causal, 0.0)
        sq, b = query.shape[0], query.shape[1]
        return out.reshape(sq, b, self.hidden_size_per_partition)

    def _attend(self, query, key, value, attention_mask, causal: bool, dropout: float) -> torch.Tensor:
        """[s, b, heads, d] in, [s, b, heads, d] out."""
        if self.cp_group is not None:
            return context_parallel_attention(query, key, value, self.cp_group, self.sdpa_scale, dropout)
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))   # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                             scale=self.sdpa_scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3)
