"""Objectives: the losses both engines train (next-token cross entropy, PPO's dual-clip policy
loss, value loss, KL and entropy terms), their per-token weights over the global mini-batch at any
DP size, and the advantages (GAE, GRPO). Pure tensor functions; imports nothing of the project."""
