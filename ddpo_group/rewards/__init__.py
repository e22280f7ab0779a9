"""Reward functions: registry, built-ins and plugin loading (see README, "Rewards")."""
