"""ddpo-group: reinforcement learning for text-to-image diffusion models.

A denoising trajectory is treated as a token sequence: each denoising step is a token
with its own log-probability and the final image gets a reward. See README.md and docs/architecture.md.
"""

__version__ = "0.1.0"

from ddpo_group import _quiet
from ddpo_group.config import moved

_quiet.install()
moved.install()
