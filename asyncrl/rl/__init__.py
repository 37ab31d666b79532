"""RL on the runtime: algorithms, prompt sources, rewards, the actor and the critic, and the
policy, rollout and reference workers (built in asyncrl.hybrid) — what flow files import."""

from asyncrl.hybrid.roles import Policy, Reference, Rollout
from asyncrl.hybrid.user_fn import load_tokenizer
from asyncrl.rl.actor import Actor
from asyncrl.rl.algorithms import (
    gae,
    grpo_advantages,
    kl_penalty,
    pass_at_k,
    ppo_policy_loss,
    whiten,
)
from asyncrl.rl.config import RLConfig
from asyncrl.rl.critic import Critic
from asyncrl.rl.data import PromptSource, read_records
from asyncrl.rl.dynamic import DynamicSamplingError, PromptsExhausted, dynamic_sampling
from asyncrl.rl.reward import RewardFn, RewardModel

__all__ = ["Actor", "Critic", "DynamicSamplingError", "Policy", "PromptSource",
           "PromptsExhausted", "RLConfig", "Reference", "RewardFn", "RewardModel", "Rollout",
           "dynamic_sampling", "gae", "grpo_advantages", "kl_penalty", "load_tokenizer",
           "pass_at_k", "ppo_policy_loss", "read_records", "whiten"]
