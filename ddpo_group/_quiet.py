"""Silence log lines known to be harmless here, so that warnings that matter and the progress bars stay readable.

Only these exact messages are dropped (each reviewed):
- transformers: "`CLIPImageProcessor` requires torchvision (not installed); falling back to ...Pil": this
  project never uses the torchvision image processors (there is no CPU torchvision build to install).
- diffusers: "There are modules in X that should be kept in float32: []": the list is empty, nothing is cast.
- accelerate's INFO lines for every file of every checkpoint (the trainer logs one line per checkpoint).
"""

import logging

_HARMLESS = {
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
    "diffusers.models.modeling_utils": ("that should be kept in float32: []",),
}


class _DropHarmless(logging.Filter):
    def __init__(self, fragments):
        super().__init__()
        self.fragments = fragments

    def filter(self, record):
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def install():
    """Add the filters (idempotent)."""
    for name, fragments in _HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless(fragments))
    for name in ("accelerate.accelerator", "accelerate.checkpointing"):
        logging.getLogger(name).setLevel(logging.WARNING)
