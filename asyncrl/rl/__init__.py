"""RL on the runtime: algorithms (this issue's first part); trainers, data, roles next."""

from asyncrl.rl.algorithms import gae, grpo_advantages, kl_penalty, ppo_policy_loss, whiten

__all__ = ["gae", "grpo_advantages", "kl_penalty", "ppo_policy_loss", "whiten"]
