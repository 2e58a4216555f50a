"""`SDPAttention`: Megatron-Core's core attention computed by torch's
`scaled_dot_product_attention` (flash / cuDNN / memory-efficient kernels), for the local layer
spec, which Megatron builds when Transformer Engine is absent.

Why: the local spec's `DotProductAttention` materialises the [b, heads, s, s] scores
(baddbmm, softmax, bmm): memory quadratic in the sequence and about half the speed of a fused
kernel at s = 2048. This class keeps Megatron's module (its parameters, state dict, TP split
and config checks) and replaces only the computation, so checkpoints and layouts are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """`DotProductAttention` with the same contract: query [sq, b, heads/tp, d], key / value
    [sk, b, groups/tp, d] -> context [sq, b, heads/tp * d]; causal (Megatron's `causal` mask
    type with no mask tensor) or an explicit boolean `attention_mask` (True = masked, Megatron's
    convention); grouped-query attention by the kernel's `enable_gqa`; the softmax scale of the
    config (1/sqrt(d), or `softmax_scale`; query-key layer scaling folds back to the same);
    attention dropout from the config under Megatron's CUDA RNG tracker.

    Falls back to the parent's computation for what SDPA does not express: sliding-window
    attention and softmax types other than 'vanilla' (`uses_sdpa` is False then)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # apply_query_key_layer_scaling divides the scale by the layer number and the softmax
        # multiplies it back (an fp16 overflow guard): the product is the scale to use.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        self.uses_sdpa = self.softmax_offset is None and self.scale_mask_softmax.window_size is None

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
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))   # [b, heads, s, d]
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, mask, causal, dropout)
        else:
            out = self._sdpa(q, k, v, mask, causal, 0.0)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, mask, causal: bool, dropout: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              scale=self.sdpa_scale, enable_gqa=k.shape[1] != q.shape[1])
