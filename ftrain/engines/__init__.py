"""Engines: the contract a rank's actor drives (`engine.Engine`) and its two implementations:
`torch_engine` (CPU, gloo, an HF model under torch DDP) and `megatron_engine` (GPU, NCCL,
Megatron-Core with TP/PP/CP/DP and the distributed optimizer), with the Megatron helpers
(`megatron_model`, `megatron_attention`, `megatron_ops`, `megatron_checkpoint`, `megatron_groups`,
`megatron_compat`: version-checked patches of Megatron-Core internals). An engine owns its rank's
process groups and state; it saves through the checkpoint manager it is handed. May call `rl`,
`state`, `data`, `distributed`, `objectives`, `config`, `failures`; never the control plane."""
