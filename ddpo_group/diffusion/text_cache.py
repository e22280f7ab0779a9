"""The text-embedding cache (config.sample.text_embedding_cache): a prompt seen again is not re-encoded.

A sampling batch repeats its prompts (a GRPO group is one prompt's images) and an epoch draws from the same prompt
set again, so most text-encoder calls of a run recompute what an earlier batch computed. The cache keeps each
prompt's row of the family's conditioning dict (``_encode``'s: embeddings, pooled embeddings, masks, SDXL's time ids,
the negative prompt's rows) and serves a batch whose rows it all holds by stacking them: no text-encoder call.

Exactness. A batch with a row the cache lacks is encoded as without the cache, whole: the same call, the same
numbers, whose rows are then stored. A batch served from the cache gets rows that a call of the same batch size
made (the key holds the batch size B): a text encoder computes every row of a batch with the same kernels at a
given shape, independently of the other rows (fixed-length padding, per-row attention masks), so a row's numbers
depend on its prompt and on B, not on its neighbours. Across batch sizes they can differ at the last bit: the
pooled projection of SD3's CLIP encoders is a matmul of B rows whose CPU kernel changes with B (tiny-sd3: up to
7e-7 apart between B = 1, 2, 3 and B = 4, 6; docs/performance.md); hence B in the key. A family whose encoding pads to the longest prompt of the batch (the sequence
length then depends on the neighbours) sets ``text_rows_independent = False`` and is never cached.

Never cached (the encoder is called as without the cache): a text encoder with a trainable parameter (its weights
change), an editing family whose text encoder reads the source image (``_encode_edit`` overridden; the base's
``_encode_edit`` caches the text part only), a family with ``text_rows_independent = False``. The key also holds
the negative prompt, the guidance scale, max_sequence_length, the resolution, the device, each text encoder's
identity and dtype (a new or moved encoder misses) and the autocast state (mixed precision encodes otherwise). LRU over at most `max_prompts` keys; identical rows of the same
field (the negative prompt's, repeated per row) are stored once.
"""

import threading
from collections import OrderedDict

import torch

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def _encoders(pipeline):
    return [(name, module) for name in TEXT_ENCODERS
            if isinstance(module := getattr(pipeline, name, None), torch.nn.Module)]


def encoder_state(pipeline):
    """(identity, trained): each text encoder's (name, id, dtype) for the key, and whether any has a trainable
    parameter (then nothing may be cached: its outputs change with its weights)."""
    identity, trained = [], False
    for name, module in _encoders(pipeline):
        params = list(module.parameters())
        trained = trained or any(p.requires_grad for p in params)
        identity.append((name, id(module), str(params[0].dtype) if params else ""))
    return tuple(identity), trained


class TextEmbeddingCache:
    """LRU of conditioning rows: (prompt, batch size, context) -> {field: row tensor or None}. `max_prompts` 0: off.

    ``encode(encode_fn, prompts, context)``: encode_fn(prompts) -> {field: (B, ...) tensor or None} is the family's
    uncached encoding; the answer equals encode_fn(prompts) bit for bit (module docstring). hits / misses count
    batches served from the cache / encoded."""

    def __init__(self, max_prompts=0):
        if int(max_prompts) < 0:
            raise ValueError(f"config.sample.text_embedding_cache={max_prompts} must be >= 0 (0: off)")
        self.max_prompts = int(max_prompts)
        self.rows = OrderedDict()
        self.shared = {}  # (field, context, B) -> the last stored row of the field: identical rows kept once
        self.hits = self.misses = 0
        self.lock = threading.Lock()  # a sampling thread and an evaluation may encode at once (the encoder call is outside)

    def clear(self):
        with self.lock:
            self.rows.clear()
            self.shared.clear()

    def encode(self, encode_fn, prompts, context):
        if self.max_prompts <= 0:
            return encode_fn(prompts)
        batch = len(prompts)
        keys = [(prompt, batch, context) for prompt in prompts]
        with self.lock:
            if all(key in self.rows for key in keys):
                self.hits += 1
                for key in keys:
                    self.rows.move_to_end(key)
                return self._stack([self.rows[key] for key in keys])
            self.misses += 1
        cond = encode_fn(prompts)
        for name, value in cond.items():
            if value is not None and not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch):
                raise ValueError(f"the text conditioning's {name!r} is not one row per prompt, so it cannot be cached: "
                                 "set sample.text_embedding_cache=0")
        with self.lock:
            for i, key in enumerate(keys):
                if key not in self.rows:
                    self.rows[key] = {name: None if value is None else self._keep(name, context, batch, value[i])
                                      for name, value in cond.items()}
                self.rows.move_to_end(key)
            while len(self.rows) > self.max_prompts:
                self.rows.popitem(last=False)
        return cond

    def _keep(self, name, context, batch, row):
        slot = (name, context, batch)
        last = self.shared.get(slot)
        if last is not None and last.shape == row.shape and last.dtype == row.dtype and torch.equal(last, row):
            return last
        row = row.clone()  # not a view: the batch's tensor is not kept alive by its rows
        self.shared[slot] = row
        return row

    @staticmethod
    def _stack(rows):
        return {name: None if rows[0][name] is None else torch.stack([row[name] for row in rows])
                for name in rows[0]}
