"""Diffusion trajectories as token sequences: log-prob scheduler step, sampler, tiny pipeline."""
