"""Agents: the random agent (rollouts); later PPO, world-model and controller training."""
