"""RL on the runtime: algorithms and prompt sources (first parts); trainers next."""

from asyncrl.rl.algorithms import gae, grpo_advantages, kl_penalty, ppo_policy_loss, whiten
from asyncrl.rl.data import PromptSource
from asyncrl.rl.reward import RewardFn

__all__ = ["PromptSource", "RewardFn", "gae", "grpo_advantages", "kl_penalty",
           "ppo_policy_loss", "whiten"]
