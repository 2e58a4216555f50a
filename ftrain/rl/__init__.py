"""RL: rollouts and tasks (`rollouts`: prompts as a pure function of seed and step, the policy's
samples scored and turned into a batch with advantages) and reward functions (`rewards`: veRL's
GSM8K rule, exact match, a user's `module:function`). May call `data`, `objectives`, `config`."""
