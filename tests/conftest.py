import os

# Tests never reach a hub or a tracking server.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# The models in tests are tiny: one thread is faster than two contending ones, and deterministic.
torch.set_num_threads(1)
