"""Model FLOPs per training step and parameter counts of the Llama-style GPT both engines build:
the numerator of MFU, in one place (bench/train_speed.py applies it to a config). FLOPs in FLOP
(a multiply-add is 2), parameters as counts; pure functions, no errors raised.

Model FLOPs per step (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, Appendix B: 6N + 12LHQT
per token; Narayanan et al. 2021, arXiv:2104.04473, Sec. 5.1 and appendix "Floating-point
operations", without activation recomputation):

    F_step = T * [ (6 + 2r) * N  +  (12 + 4r) * L * h * s ]        (FLOP)

  T = train.global_batch_size * train.seq_len, tokens per step (padding included, as
      `tokens_per_s` in metrics.py);
  N = L * (4 h^2 + 3 h f) + h * V, parameters in matmuls: attention q, k, v, o (kv heads =
      heads) and the SwiGLU gate, up, down per layer, plus the output layer (untied); the input
      embedding (a lookup) and the RMSNorm weights (elementwise) do no matmul FLOPs;
  L = model.num_layers, h = model.hidden_size, f = model.ffn_hidden_size, s = train.seq_len,
  V = model.vocab_size (padded to a multiple of 128 on the Megatron engine);
  6N    = forward 2N (2 FLOP per multiply-add) + backward 4N;
  12Lhs = attention scores QK^T and the weighted sum AV: 2 matmuls x 2 FLOP x s x h per token
          per layer forward, x3 with backward; over the full s x s (causal masking not
          discounted, as PaLM);
  r = 1 when the step also runs a forward-only pass over the whole batch for the old-policy
         log-probs (PPO with more than one optimizer update per step: `ppo.behaviour_pass_needed`):
         2N + 4Lhs per token; r = 0 for `ce` and one-update PPO, which run no such pass (no
         credit for a pass that is not needed).
With r = 0 and a plain MLP of f = 4h (2 matrices) this is Narayanan et al.'s 96 B s L h^2
(1 + s/(6h) + V/(16 L h)) without its recomputed forward: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)).
"""

FORMULA = ("T * ((6 + 2r) * N + (12 + 4r) * L * h * s), N = L * (4h^2 + 3hf) + hV, "
           "r = 1 with a separate old-log-prob pass (PPO, several updates per step), else 0")


def matmul_params(layers: int, hidden: int, ffn: int, vocab: int, mlp_matrices: int = 3) -> int:
    """N: parameters that take part in matmuls, L * (4 h^2 + mlp_matrices * h * f) + h * V
    (attention q, k, v, o; MLP: 3 matrices for SwiGLU, 2 for a plain MLP; the output layer).
    Excludes the input embedding (a lookup) and norm weights (elementwise)."""
    return layers * (4 * hidden * hidden + mlp_matrices * hidden * ffn) + hidden * vocab


def total_params(layers: int, hidden: int, ffn: int, vocab: int) -> int:
    """Every parameter of the Llama-style model both engines build (untied embedding and
    output layer, two RMSNorms per layer and a final one): L (4h^2 + 3hf + 2h) + 2Vh + h."""
    return layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + 2 * vocab * hidden + hidden


def flops_per_token(n_matmul: int, layers: int, hidden: int, seq_len: int,
                    old_logprob_pass: bool = True) -> float:
    """Model FLOPs per token of one step: (6 + 2r) N + (12 + 4r) L h s, r = 1 when the step also
    runs a forward-only pass (PPO old-policy log-probs). See the module docstring."""
    r = 1 if old_logprob_pass else 0
    return (6 + 2 * r) * n_matmul + (12 + 4 * r) * layers * hidden * seq_len
