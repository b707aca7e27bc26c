"""Reinforcement learning's building blocks for looped models: environments (prompts and a
verifiable reward), group rollouts through megaloop's Generator, objectives (GRPO and RLTT as pure
functions of tensors) and the per-step telemetry "Closing the Loop" (arXiv 2610.00673) Appendix C
reads to tell whether RL moves the policy."""
