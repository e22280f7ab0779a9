"""Source images of image-editing prompts: reading them, checking them, handing them to the policy and the rewards.

An editing model (FLUX.1 Kontext, Qwen-Image-Edit: a family with ``conditions_on_images``) edits one source
image per prompt. A prompt record names it in its metadata (docs/editing.md):

    {"prompt": "make the circle blue", "source_image": "sources/red_circle.png"}

a path relative to the prompt file (``prompts.py`` makes it absolute when it reads the file). A family that edits
several sources per prompt (Qwen-Image-Edit-2509 / 2511: its ``max_source_images`` > 1) reads the field
``source_images``, a list of such paths ("Picture 1", "Picture 2", ... in order; ``source_image`` counts as a list of
one), the same number for every prompt of a run. The image must be
an RGB(A) / grayscale file PIL reads, of exactly the sampled resolution (sample.resolution) on both sides: the
edit is compared pixel for pixel with its source, so nothing is resized silently.

- ``source_images(records)`` (B, 3, H, W) float32 in [0, 1] on the CPU ((B, K, 3, H, W) when the records use
  ``source_images``), or None when no record has one: what ``policy.sample(..., source_images=...)`` encodes into
  the trajectories' conditioning;
- ``reward_metadata(metadata, sources)``: the rewards' metadata, with ``source_image`` the image itself, a float32
  CPU tensor (3, H, W) in [0, 1], and ``source_image_path`` its path (the reward contract, rewards/base.py); with
  several sources, ``source_images`` the list of K such tensors and ``source_image_paths`` their paths
  (``source_image`` / ``source_image_path``: the first);
- ``check_edit_prompts(records, ...)``: one-line errors naming the field and the record before any model loads.

Imports nothing of the package.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

SOURCE_FIELD = "source_image"
SOURCE_PATH_FIELD = "source_image_path"
SOURCES_FIELD = "source_images"
SOURCE_PATHS_FIELD = "source_image_paths"


def _resolve(path, prompt_file: str, where: str, field: str) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: field '{field}' must be a path to an image file, got {path!r}")
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(prompt_file)), path)
    return os.path.normpath(path)


def resolve_source_path(metadata: dict, prompt_file: str, where: str) -> None:
    """Make metadata['source_image'] (and each path of metadata['source_images']) absolute, relative to the prompt
    file's directory (in place)."""
    if SOURCE_FIELD in metadata and SOURCES_FIELD in metadata:
        raise ValueError(f"{where}: give either the field '{SOURCE_FIELD}' or '{SOURCES_FIELD}', not both")
    if SOURCE_FIELD in metadata:
        metadata[SOURCE_FIELD] = _resolve(metadata[SOURCE_FIELD], prompt_file, where, SOURCE_FIELD)
    if SOURCES_FIELD in metadata:
        paths = metadata[SOURCES_FIELD]
        if not isinstance(paths, list) or not paths:
            raise ValueError(f"{where}: field '{SOURCES_FIELD}' must be a non-empty list of image paths, got {paths!r}")
        metadata[SOURCES_FIELD] = [_resolve(path, prompt_file, where, SOURCES_FIELD) for path in paths]


def record_sources(metadata: dict) -> list | None:
    """A record's source paths: its 'source_images' list, its 'source_image' as a list of one, None when it has none."""
    if SOURCES_FIELD in metadata:
        return list(metadata[SOURCES_FIELD])
    return [metadata[SOURCE_FIELD]] if SOURCE_FIELD in metadata else None


@lru_cache(maxsize=512)
def _read_uint8(path: str, mtime: float) -> torch.Tensor:
    """(3, H, W) uint8 of an image file (cached by path and modification time: a prompt's source is read once)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()


def read_source_image(path: str, where: str = "", resolution: int = 0, field: str = SOURCE_FIELD) -> torch.Tensor:
    """(3, H, W) float32 in [0, 1] of the source image at `path`; ValueError naming the field and the file when it
    is not a regular file (a FIFO would block the read), cannot be read (PIL's decompression-bomb limit included)
    or (resolution > 0) is not resolution x resolution."""
    from PIL import Image

    prefix = f"{where}: " if where else ""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{prefix}field '{field}' {path!r} is not a regular file; give an image file")
    try:
        pixels = _read_uint8(path, os.path.getmtime(path))
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(
            f"{prefix}field '{field}' {path!r} cannot be read as an image ({type(err).__name__}: {err})"
        ) from None
    if resolution and tuple(pixels.shape[1:]) != (resolution, resolution):
        raise ValueError(
            f"{prefix}field '{field}' {path!r} is {pixels.shape[2]}x{pixels.shape[1]} pixels; "
            f"config.sample.resolution is {resolution}: give a {resolution}x{resolution} source image"
        )
    return pixels.float() / 255.0


def source_images(records, resolution: int = 0) -> torch.Tensor | None:
    """(B, 3, H, W) float32 in [0, 1] of the records' source images, None when no record has one; (B, K, 3, H, W)
    when a record names its sources in the field 'source_images' (K per record, the same for all)."""
    if any(SOURCES_FIELD in record.metadata for record in records):
        return _several_sources(records, resolution)
    paths = [record.metadata.get(SOURCE_FIELD) for record in records]
    if all(path is None for path in paths):
        return None
    missing = [i for i, path in enumerate(paths) if path is None]
    if missing:
        raise ValueError(f"prompt {records[missing[0]].prompt!r} has no field '{SOURCE_FIELD}' while others of the "
                         "batch have one: give every prompt of an editing run a source image")
    images = [read_source_image(path, f"prompt {record.prompt!r}", resolution) for path, record in zip(paths, records)]
    shapes = {tuple(image.shape) for image in images}
    if len(shapes) > 1:
        raise ValueError(f"field '{SOURCE_FIELD}': the source images of one batch differ in size {sorted(shapes)}; "
                         "set config.sample.resolution and give every source image that size")
    return torch.stack(images)


def _several_sources(records, resolution: int) -> torch.Tensor:
    """(B, K, 3, H, W) of records with K sources each ('source_images', or 'source_image' as one)."""
    lists = [record_sources(record.metadata) for record in records]
    for record, paths in zip(records, lists):
        if paths is None:
            raise ValueError(f"prompt {record.prompt!r} has no field '{SOURCES_FIELD}' while others of the batch have "
                             "one: give every prompt of an editing run its source images")
    counts = sorted({len(paths) for paths in lists})
    if len(counts) > 1:
        raise ValueError(f"field '{SOURCES_FIELD}': the prompts of one batch have {counts} source images; give every "
                         "prompt of a run the same number")
    images = [torch.stack([read_source_image(path, f"prompt {record.prompt!r}", resolution, SOURCES_FIELD)
                           for path in paths]) for paths, record in zip(lists, records)]
    shapes = {tuple(image.shape) for image in images}
    if len(shapes) > 1:
        raise ValueError(f"field '{SOURCES_FIELD}': the source images of one batch differ in size; set "
                         "config.sample.resolution and give every source image that size")
    return torch.stack(images)


def reward_metadata(metadata, sources: torch.Tensor | None) -> list:
    """The rewards' metadata: copies of `metadata` with source_image the (3, H, W) float32 CPU image in [0, 1] and
    source_image_path its path; `metadata` itself when there are no sources."""
    if sources is None:
        return list(metadata)
    if sources.dim() == 5:  # several sources per prompt: the list, and the first as 'source_image'
        out = []
        for meta, images in zip(metadata, sources):
            meta, paths = dict(meta), record_sources(meta) or [None] * len(images)
            meta[SOURCE_PATHS_FIELD], meta[SOURCE_PATH_FIELD] = paths, paths[0]
            meta[SOURCES_FIELD] = [image.clone() for image in images]
            meta[SOURCE_FIELD] = images[0].clone()
            out.append(meta)
        return out
    out = []
    for meta, image in zip(metadata, sources):
        meta = dict(meta)
        meta[SOURCE_PATH_FIELD] = meta.get(SOURCE_FIELD)
        meta[SOURCE_FIELD] = image.clone()  # the reward's own copy, as its images are
        out.append(meta)
    return out


def check_edit_prompts(records, conditions_on_images: bool, resolution: int, field: str, model: str,
                       max_sources: int = 1) -> None:
    """Before any model loads: an editing model needs a readable source image of the run's resolution on every
    prompt (config.<field>); a model that does not condition on images is refused a source image. A model that
    edits several (``max_sources`` > 1) needs 1 to max_sources of them per prompt, the same number on every prompt;
    one that edits one is refused the field 'source_images'."""
    if conditions_on_images and max_sources > 1:
        _check_several_sources(records, resolution, field, model, max_sources)
        return
    several = [record for record in records if SOURCES_FIELD in record.metadata]
    if several:
        what = "edits one image per prompt: give it the field 'source_image'" if conditions_on_images else (
            "does not edit images: use an editing model or drop the field")
        raise ValueError(f"config.{field}: prompt {several[0].prompt!r} has a field '{SOURCES_FIELD}' but "
                         f"config.pretrained.model={model!r} {what}")
    has = [SOURCE_FIELD in record.metadata for record in records]
    if conditions_on_images:
        if not all(has):
            record = records[has.index(False)]
            raise ValueError(
                f"config.{field}: prompt {record.prompt!r} has no field '{SOURCE_FIELD}'; config.pretrained.model="
                f"{model!r} conditions on an image (editing, image-to-video): give each record a source image (a path "
                "relative to the prompt file)"
            )
        for record in records:
            read_source_image(record.metadata[SOURCE_FIELD], f"config.{field}: prompt {record.prompt!r}", resolution)
    elif any(has):
        record = records[has.index(True)]
        raise ValueError(
            f"config.{field}: prompt {record.prompt!r} has a field '{SOURCE_FIELD}' but config.pretrained.model="
            f"{model!r} does not edit images: use an editing model (FLUX.1 Kontext, Qwen-Image-Edit) or drop the field"
        )


def _check_several_sources(records, resolution: int, field: str, model: str, max_sources: int) -> None:
    """check_edit_prompts for a model that edits 1 to max_sources images per prompt."""
    counts = {}
    for record in records:
        paths = record_sources(record.metadata)
        where = f"config.{field}: prompt {record.prompt!r}"
        if paths is None:
            raise ValueError(f"{where} has no field '{SOURCES_FIELD}'; config.pretrained.model={model!r} edits images: "
                             f"give each record a list of 1 to {max_sources} source images (paths relative to the "
                             "prompt file)")
        if not 1 <= len(paths) <= max_sources:
            raise ValueError(f"{where}: field '{SOURCES_FIELD}' lists {len(paths)} images; config.pretrained.model="
                             f"{model!r} takes 1 to {max_sources}")
        counts.setdefault(len(paths), record.prompt)
        for path in paths:
            read_source_image(path, where, resolution, SOURCES_FIELD)
    if len(counts) > 1:
        (n, first), (m, other) = sorted(counts.items())[:2]
        raise ValueError(f"config.{field}: field '{SOURCES_FIELD}': prompt {first!r} has {n} source images and prompt "
                         f"{other!r} {m}; give every prompt of a run the same number")


def edit_pairs_html(run_dir: str, epoch: int | None = None, max_pairs: int = 16) -> str:
    """The HTML report's fragment of an editing run: source -> edited pairs of an epoch's samples (the last epoch
    with samples when `epoch` is None), each with its prompt and reward; "" for a run without source images.

    Reads samples/epoch_XXXX.json (written by grids.save_epoch_samples with sources) and embeds the PNGs it names
    as data URIs, so the fragment stands alone; a file outside the run directory (links resolved) is never read,
    its place says so. For ddpo_group/report/inspect.py's report (a section after the sample grids)."""
    import base64
    import glob
    import html
    from pathlib import Path

    from ddpo_group.report.run import inside_run, read_records_file, unreadable_image

    samples = os.path.join(run_dir, "samples")
    documents = sorted(glob.glob(os.path.join(samples, "epoch_[0-9][0-9][0-9][0-9].json")))
    # load_run names the others in the report: links out of the run, folders
    documents = [d for d in documents if inside_run(d, run_dir) and os.path.isfile(d)]
    if epoch is not None:
        documents = [d for d in documents if d.endswith(f"epoch_{epoch:04d}.json")]
    document = None
    for path in reversed(documents):  # the last one that can be read: load_run names the others in the report
        try:
            document, records = read_records_file(Path(path))
            shown = Path(path).stem.removeprefix("epoch_")
            break
        except (OSError, ValueError):
            continue
    if document is None:
        return ""
    pairs = [r for r in records if r.get("source_image")][:max_pairs]
    if not pairs:
        return ""

    def image(rel):
        if not inside_run(os.path.join(samples, str(rel)), run_dir):
            return f'<span class="missing">not shown: {html.escape(str(rel))} is outside the run directory</span>'
        if (why := unreadable_image(os.path.join(samples, str(rel)))) is not None:  # a folder, a decompression bomb
            return f'<span class="missing">not shown: {html.escape(str(rel))} ({html.escape(why)})</span>'
        with open(os.path.join(samples, rel), "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        mime = "image/webp" if str(rel).endswith(".webp") else "image/png"  # an image-to-video run's clips: WebP
        return f'<img src="data:{mime};base64,{data}" style="width:128px;image-rendering:pixelated">'

    def reward(value):
        return f"{value:.4g}" if isinstance(value, (int, float)) else html.escape(str(value))

    rows = "".join(
        f"<tr><td>{image(r['source_image'])}</td><td>&rarr;</td><td>{image(r.get('image', ''))}</td>"
        f"<td>{html.escape(str(r['prompt']))}<br>reward {reward(r['reward'])}</td></tr>"
        for r in pairs
    )
    return (f"<section><h2>Edits of epoch {int(shown)}: source &rarr; edited</h2>"
            f"<table>{rows}</table></section>")
