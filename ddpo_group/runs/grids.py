"""Sample grids: one PNG per logged epoch, rows = prompts, columns = group members.

`save_epoch_samples` is what the trainer calls every `log_images_every` epochs. It writes,
under `run_dir/samples/`:

    epoch_XXXX.png        the grid (each cell captioned "r=<reward> a=<advantage>", the prompt on the left)
    epoch_XXXX/NNN.png    every sample on its own, NNN = its index in the epoch batch
    epoch_XXXX.json       {"epoch", "group_size", "grid", "records": [{index, prompt, reward, advantage, image}]}
                          where `grid` and each `image` are paths relative to the samples/ folder (`grid` is
                          null when max_rows=0); `extra` adds document fields, `record_fields` fields per record

Videos (N, F, 3, H, W) are moving pictures: every sample is samples/epoch_XXXX/NNN.webp and the grid
epoch_XXXX.webp, animated WebP (Pillow, lossless, looping, `fps` frames a second), each grid frame the
grid of that frame of every video; the JSON says "video": true and each record its "frames".
`video_samples_html` is the report's fragment for them. A video with sound (LTX-2) also keeps its soundtrack
beside it, samples/epoch_XXXX/NNN.wav (16-bit PCM, the standard library's `wave`), its record's "audio";
`audio_samples_html` is the report's fragment that plays them.

Every file is written to a temporary file in the same folder and moved into place with
`os.replace`, so a crash never leaves a half-written PNG or JSON behind. The JSON is written
last: when it exists, the images it names exist too.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

BACKGROUND = (255, 255, 255)
EMPTY_CELL = (230, 230, 230)
TEXT_COLOR = (0, 0, 0)
FONT_SIZE = 11
# Auto upscale makes a cell at least this wide, so that "r=0.83 a=+1.20" fits under it.
MIN_CELL_WIDTH = 96


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x)


def _font() -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=FONT_SIZE)
    except TypeError:  # Pillow < 10.1, or built without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _text_width(draw: ImageDraw.ImageDraw, text: str, font) -> float:
    return draw.textlength(text, font=font)


def _line_height(font) -> int:
    left, top, right, bottom = font.getbbox("Ag")
    return int(bottom) + 2


def to_uint8_hwc(image: Any) -> np.ndarray:
    """Convert one image (3, H, W) float in [0, 1] to (H, W, 3) uint8.

    value = round(clip(x, 0, 1) * 255), rounding halves up (floor(x * 255 + 0.5)).
    """
    array = _to_numpy(image).astype(np.float64)
    if array.ndim != 3 or array.shape[0] != 3:
        raise ValueError(f"images: each image must have shape (3, H, W), got {tuple(array.shape)}")
    array = np.floor(np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    return np.ascontiguousarray(array.transpose(1, 2, 0))


def auto_upscale(width: int) -> int:
    """Integer nearest-neighbour factor s = max(1, ceil(MIN_CELL_WIDTH / width)): 32 -> 3, 64 -> 2, 256 -> 1."""
    return max(1, math.ceil(MIN_CELL_WIDTH / width))


def _fit_lines(draw, text: str, font, max_width: float, max_lines: int) -> list[str]:
    """Greedy word wrap to lines at most `max_width` pixels wide; truncate with '...' past `max_lines`.

    Bounded time whatever the text: only the characters that could ever be shown are wrapped (at most
    max_lines lines of the narrowest character), and a word longer than a line is cut by bisection.
    """
    if max_lines < 1:
        return []
    narrowest = max(1.0, min(_text_width(draw, c, font) for c in ".il|'"))
    limit = max_lines * (int(max_width // narrowest) + 2)
    cut_off = len(text) > limit
    text = text[:limit]
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if _text_width(draw, candidate, font) <= max_width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while len(word) > 1 and _text_width(draw, word, font) > max_width:  # break a word longer than a line
            lo, hi = 1, len(word) - 1  # the longest prefix that fits, by bisection (at least one character)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _text_width(draw, word[:mid], font) <= max_width:
                    lo = mid
                else:
                    hi = mid - 1
            lines.append(word[:lo])
            word = word[lo:]
        current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines or cut_off:
        lines = lines[:max_lines]
        last = lines[-1] if lines else ""
        while last and _text_width(draw, last + "...", font) > max_width:
            last = last[:-1]
        lines[-1:] = [last.rstrip() + "..."]
    return lines


def make_grid(
    images: Any,
    nrow: int,
    captions: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    upscale: int | None = None,
    padding: int = 2,
    caption_height: int | None = None,
    label_width: int = 160,
) -> Image.Image:
    """Tile images into a captioned grid, `nrow` images per row (the torchvision convention).

    images: (N, 3, H, W) float in [0, 1] (torch or numpy), or a sequence of N such (3, H, W)
        images where None marks an empty cell (drawn in light grey). Placed row-major:
        image i goes to row i // nrow, column i % nrow; rows = ceil(N / nrow).
    captions: N strings drawn under their image (e.g. "r=0.83 a=+1.20"), or None.
    row_labels: one string per row drawn left of the row (wrapped, truncated with "..."), or None.
    upscale: integer nearest-neighbour factor s; None picks `auto_upscale(W)` (32x32 -> 96x96).

    Layout, in pixels (cw = W*s, ch = H*s; cap = caption_height, default a text line when
    captions are given and 0 otherwise; lab = label_width when row_labels are given, else 0):
        width  = lab + padding + ncol * (cw + padding)
        height = padding + rows * (ch + cap + padding)
        image (r, c) top-left corner = (lab + padding + c*(cw + padding), padding + r*(ch + cap + padding))
    where ncol = nrow.
    """
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    if isinstance(images, (list, tuple)):
        cells = [None if image is None else to_uint8_hwc(image) for image in images]
    else:
        array = _to_numpy(images)
        if array.ndim != 4 or array.shape[1] != 3:
            raise ValueError(f"images must have shape (N, 3, H, W) with values in [0, 1], got {tuple(array.shape)}")
        cells = [to_uint8_hwc(image) for image in array]
    present = [cell for cell in cells if cell is not None]
    if not present:
        raise ValueError("images: need at least one image (got none, or only empty cells)")
    height, width = present[0].shape[:2]
    if any(cell.shape[:2] != (height, width) for cell in present):
        raise ValueError("images: all images must have the same height and width")
    num_cells = len(cells)
    if captions is not None and len(captions) != num_cells:
        raise ValueError(f"captions: expected {num_cells} strings (one per image), got {len(captions)}")
    num_rows = math.ceil(num_cells / nrow)
    if row_labels is not None and len(row_labels) != num_rows:
        raise ValueError(f"row_labels: expected {num_rows} strings (one per row), got {len(row_labels)}")

    scale = auto_upscale(width) if upscale is None else int(upscale)
    if scale < 1:
        raise ValueError(f"upscale must be a positive integer or None (auto), got {upscale}")
    font = _font()
    if caption_height is None:
        caption_height = _line_height(font) + 2 if captions is not None else 0
    label_w = label_width if row_labels is not None else 0
    cell_w, cell_h = width * scale, height * scale
    step_x, step_y = cell_w + padding, cell_h + caption_height + padding

    grid = Image.new("RGB", (label_w + padding + nrow * step_x, padding + num_rows * step_y), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    for i, cell in enumerate(cells):
        row, col = divmod(i, nrow)
        x, y = label_w + padding + col * step_x, padding + row * step_y
        if cell is None:
            draw.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=EMPTY_CELL)
            continue
        tile = Image.fromarray(cell, mode="RGB")
        if scale != 1:
            tile = tile.resize((cell_w, cell_h), resample=Image.Resampling.NEAREST)
        grid.paste(tile, (x, y))
        if captions is not None and caption_height > 0:
            line = _fit_lines(draw, captions[i], font, cell_w, 1)
            if line:
                draw.text((x + 1, y + cell_h + 1), line[0], fill=TEXT_COLOR, font=font)
    if row_labels is not None:
        max_lines = max(1, (cell_h + caption_height) // _line_height(font))
        for row, label in enumerate(row_labels):
            lines = _fit_lines(draw, label, font, label_w - 2 * padding - 2, max_lines)
            draw.multiline_text(
                (padding + 1, padding + row * step_y), "\n".join(lines), fill=TEXT_COLOR, font=font, spacing=2
            )
    return grid


def format_caption(reward: float, advantage: float | None) -> str:
    """'r=0.83 a=+1.20' (advantage signed; 'a=n/a' when there is none)."""
    adv = "n/a" if advantage is None or not np.isfinite(advantage) else f"{advantage:+.2f}"
    return f"r={reward:.2f} a={adv}"


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through `write(tmp_path)` to a temporary file beside `path`, then os.replace it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name in the same folder (os.replace is atomic only within one file system).
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_png(image: Image.Image, path: str | os.PathLike) -> None:
    """Save a PIL image as PNG atomically."""
    atomic_write(Path(path), lambda tmp: image.save(tmp, format="PNG"))


def save_animation(frames: Sequence[Image.Image], path: str | os.PathLike, fps: float = 16.0) -> None:
    """Save frames as a looping, lossless animated WebP atomically (one frame: a still WebP)."""
    duration = max(1, round(1000 / fps))
    atomic_write(Path(path), lambda tmp: frames[0].save(
        tmp, format="WEBP", save_all=True, append_images=list(frames[1:]), duration=duration, loop=0, lossless=True,
    ))


def save_wav(waveform: Any, sample_rate: int, path: str | os.PathLike) -> None:
    """Save a (channels, samples) float waveform in [-1, 1] (clipped) as a 16-bit PCM WAV atomically (``wave``)."""
    import wave

    pcm = (np.clip(np.asarray(waveform, dtype=np.float64), -1.0, 1.0) * 32767).round().astype("<i2")

    def write(tmp: str) -> None:
        with wave.open(tmp, "wb") as f:
            f.setnchannels(pcm.shape[0])
            f.setsampwidth(2)
            f.setframerate(int(sample_rate))
            f.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # interleaved frames

    atomic_write(Path(path), write)


def save_json(obj: Any, path: str | os.PathLike) -> None:
    """Save a JSON document atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")

    atomic_write(Path(path), write)


def group_rows(prompts: Sequence[str], group_size: int) -> list[tuple[str, list[int]]]:
    """Arrange sample indices into grid rows: (prompt, indices) per row.

    Rows follow each prompt's first appearance; a row holds at most `group_size` copies of one
    prompt, in index order (a prompt sampled k*group_size times fills k rows; fewer than
    group_size copies leave the rest of its row empty).
    """
    by_prompt: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_prompt.setdefault(prompt, []).append(index)
    rows = []
    for prompt, indices in by_prompt.items():
        for start in range(0, len(indices), group_size):
            rows.append((prompt, indices[start : start + group_size]))
    return rows


def save_epoch_samples(
    run_dir: str | os.PathLike,
    epoch: int,
    images: Any,
    prompts: Sequence[str],
    rewards: Any,
    advantages: Any,
    group_size: int,
    max_rows: int = 8,
    upscale: int | None = None,
    prefix: str = "epoch",
    extra: dict | None = None,
    record_fields: Sequence[dict] | None = None,
    fps: float = 16.0,
    sources: Any = None,
    audio: Any = None,
    audio_sample_rate: int | None = None,
) -> Path | None:
    """Write the epoch's grid, single images and JSON records; return the grid path (None with max_rows=0).

    Files are named samples/{prefix}_XXXX (prefix "eval" for the fixed evaluation grids).
    extra: more fields of the JSON document (e.g. the evaluation's seed); record_fields: N dicts, each merged
    into its sample's record (e.g. {"prompt_index": i, "image_index": j}).

    images: (N, 3, H, W) float in [0, 1], or videos (N, F, 3, H, W) (animated WebP files at `fps`, module docstring);
    prompts: N strings; rewards: (N,); advantages: (N,)
    per-sample advantages, or None. Grid rows come from `group_rows(prompts, group_size)`,
    capped at `max_rows` rows (0: no grid image); `group_size` columns. Every sample (not only those in the grid)
    is saved as samples/epoch_XXXX/NNN.png and listed in samples/epoch_XXXX.json.
    sources: (N, 3, H, W) in [0, 1], the source image each sample edits (an editing run), or None. With sources
    each grid row starts with its prompt's source (caption "source"), then its edits: source -> edited side by
    side; each sample's source is saved as samples/epoch_XXXX/NNN_source.png, its record's "source_image".
    audio: (N, channels, samples) float waveforms in [-1, 1] (a video model with sound) at `audio_sample_rate` Hz,
    or None: each is saved as samples/epoch_XXXX/NNN.wav, its record's "audio".
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0 (0: no grid image), got {max_rows}")
    array = _to_numpy(images)
    video = array.ndim == 5
    if array.ndim not in (4, 5) or array.shape[-3] != 3:
        raise ValueError(
            f"images must have shape (N, 3, H, W) or videos (N, F, 3, H, W) with values in [0, 1], got {tuple(array.shape)}"
        )
    num = array.shape[0]
    if num == 0:
        raise ValueError("images: need at least one sample, got N = 0")
    prompts = [str(p) for p in prompts]
    rewards = _to_numpy(rewards).astype(np.float64)
    if len(prompts) != num:
        raise ValueError(f"prompts: expected {num} prompts (one per image), got {len(prompts)}")
    if rewards.shape != (num,):
        raise ValueError(f"rewards must have shape ({num},), got {tuple(rewards.shape)}")
    has_advantages = advantages is not None  # an evaluation has none: its captions show the reward only
    if advantages is None:
        advantages = np.full(num, np.nan)
    advantages = _to_numpy(advantages).astype(np.float64)
    if advantages.shape != (num,):
        raise ValueError(
            f"advantages must have shape ({num},) (one per sample) or be None, got {tuple(advantages.shape)}; "
            "for per-step advantages (N, T) pass one column, e.g. advantages[:, 0]"
        )

    samples_dir = Path(run_dir) / "samples"
    stem = f"{prefix}_{epoch:04d}"
    digits = max(3, len(str(num - 1)))
    source_array = None if sources is None else _to_numpy(sources)
    if source_array is not None and source_array.ndim == array.ndim + 1:  # several sources per sample: the first
        source_array = source_array[:, 0]
    source_stills = source_array  # the source PNGs; an image-to-video model's first frame is one still per clip
    still = tuple(array.shape[:1]) + tuple(array.shape[-3:])  # an image-to-video run's sources: one image per video
    if source_array is not None and tuple(source_array.shape) not in (tuple(array.shape), still):
        raise ValueError(f"sources must have the images' shape {tuple(array.shape)}, got {tuple(source_array.shape)}")
    animate_source = source_array is not None and source_array.ndim < array.ndim  # the grid shows it in every frame
    audio_array = None if audio is None else _to_numpy(audio)
    if audio_array is not None and (audio_array.ndim != 3 or audio_array.shape[0] != num or not audio_sample_rate):
        raise ValueError(f"audio must be (N, channels, samples) with N = {num} and an audio_sample_rate, got "
                         f"{tuple(audio_array.shape)} at {audio_sample_rate}")
    records = []
    for index in range(num):
        if video:
            image_rel = f"{stem}/{index:0{digits}d}.webp"
            frames = [Image.fromarray(to_uint8_hwc(frame), mode="RGB") for frame in array[index]]
            save_animation(frames, samples_dir / image_rel, fps)
        else:
            image_rel = f"{stem}/{index:0{digits}d}.png"
            save_png(Image.fromarray(to_uint8_hwc(array[index]), mode="RGB"), samples_dir / image_rel)
        advantage = float(advantages[index])
        records.append(
            {
                "index": index,
                "prompt": prompts[index],
                "reward": float(rewards[index]),
                "advantage": advantage if np.isfinite(advantage) else None,
                "image": image_rel,
                **({"frames": int(array.shape[1])} if video else {}),
                **(record_fields[index] if record_fields is not None else {}),
            }
        )
        if audio_array is not None:
            audio_rel = f"{stem}/{index:0{digits}d}.wav"
            save_wav(audio_array[index], int(audio_sample_rate), samples_dir / audio_rel)
            records[-1]["audio"] = audio_rel
        if source_array is not None:
            source_rel = f"{stem}/{index:0{digits}d}_source.png"
            save_png(Image.fromarray(to_uint8_hwc(source_stills[index]), mode="RGB"), samples_dir / source_rel)
            records[-1]["source_image"] = source_rel

    grid_path = None
    if max_rows:
        rows = group_rows(prompts, group_size)[:max_rows]
        cells: list[Any] = []
        captions: list[str] = []
        for _, indices in rows:
            if source_array is not None:  # the row's source first: source -> edited
                source = source_array[indices[0]]
                cells.append(np.repeat(source[None], array.shape[1], axis=0) if animate_source else source)
                captions.append("source")
            for slot in range(group_size):
                if slot < len(indices):
                    index = indices[slot]
                    cells.append(array[index])
                    captions.append(format_caption(rewards[index], advantages[index]) if has_advantages
                                    else f"r={rewards[index]:.2f}")
                else:
                    cells.append(None)
                    captions.append("")
        # a prompt sampled more than group_size times fills several rows: one advantage group (grouped by prompt)
        labels = [p if i == 0 or rows[i - 1][0] != p else f"(same prompt, same group as the row above) {p}"
                  for i, (p, _) in enumerate(rows)]
        columns = group_size + (source_array is not None)
        if video:  # one grid per frame, the frames of the animation
            grids = [make_grid([None if cell is None else cell[f] for cell in cells], columns, captions=captions,
                               row_labels=labels, upscale=upscale) for f in range(array.shape[1])]
            grid_path = samples_dir / f"{stem}.webp"
            save_animation(grids, grid_path, fps)
        else:
            grid = make_grid(cells, columns, captions=captions, row_labels=labels, upscale=upscale)
            grid_path = samples_dir / f"{stem}.png"
            save_png(grid, grid_path)
    document = {"epoch": int(epoch), "group_size": int(group_size), "grid": grid_path.name if grid_path else None}
    if video:
        document["video"] = True
    save_json({**document, **(extra or {}), "records": records}, samples_dir / f"{stem}.json")
    return grid_path


def video_samples_html(run_dir: str | os.PathLike, prefix: str = "epoch", max_grids: int = 2) -> str:
    """The report's fragment for a video run: the last `max_grids` animated grids of samples/{prefix}_XXXX.json
    (those marked "video") inlined as data URIs under a heading, each captioned with its epoch; "" when the run
    has no video samples (an image run: the report's own grids show it). A grid outside the run directory (links
    resolved) is never read: its place says so."""
    import base64
    import html

    from ddpo_group.report.run import inside_run, unreadable_image

    samples_dir = Path(run_dir) / "samples"
    documents = []
    for path in sorted(samples_dir.glob(f"{prefix}_*.json")):
        if not inside_run(path, run_dir) or not path.is_file():  # load_run names it in the report
            continue
        try:  # one that cannot be read: load_run names it in the report
            with open(path, encoding="utf-8") as f:
                document = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(document, dict):
            continue
        if document.get("video") and document.get("grid") and (samples_dir / str(document["grid"])).is_file():
            documents.append(document)
    if not documents:
        return ""
    parts = [f"<h2>{'Evaluation' if prefix == 'eval' else 'Sample'} videos</h2>"]
    for document in documents[-max_grids:]:
        if not inside_run(samples_dir / str(document["grid"]), run_dir):
            parts.append(f'<p class="missing">epoch {html.escape(str(document["epoch"]))}: not shown: '
                         f'{html.escape(str(document["grid"]))} is outside the run directory</p>')
            continue
        if (why := unreadable_image(samples_dir / str(document["grid"]))) is not None:  # a decompression bomb
            parts.append(f'<p class="missing">epoch {html.escape(str(document["epoch"]))}: not shown: '
                         f'{html.escape(str(document["grid"]))} ({html.escape(why)})</p>')
            continue
        data = base64.b64encode((samples_dir / document["grid"]).read_bytes()).decode("ascii")
        caption = html.escape(f"epoch {document['epoch']} ({document['grid']}, animated WebP)")
        parts.append(f'<figure><img src="data:image/webp;base64,{data}" alt="{caption}"><figcaption>{caption}'
                     "</figcaption></figure>")
    return "\n".join(parts)


def audio_samples_html(run_dir: str | os.PathLike, prefix: str = "epoch", max_samples: int = 8) -> str:
    """The report's fragment for a run with sound: the last samples/{prefix}_XXXX.json whose records name WAV files
    ("audio"), its first `max_samples` of them as <audio> players (WAV data URIs) captioned with the prompt and
    reward; "" when the run has none. A file outside the run directory (links resolved) is never read."""
    import base64
    import html

    from ddpo_group.report.run import inside_run

    samples_dir = Path(run_dir) / "samples"
    chosen = None
    for path in sorted(samples_dir.glob(f"{prefix}_*.json")):
        if not inside_run(path, run_dir) or not path.is_file():
            continue
        try:
            with open(path, encoding="utf-8") as f:
                document = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(document, dict) and any(isinstance(r, dict) and r.get("audio")
                                              for r in document.get("records") or []):
            chosen = document
    if chosen is None:
        return ""
    parts = [f"<h2>{'Evaluation' if prefix == 'eval' else 'Sample'} audio (epoch {html.escape(str(chosen['epoch']))})"
             "</h2>"]
    for record in [r for r in chosen["records"] if isinstance(r, dict) and r.get("audio")][:max_samples]:
        file = samples_dir / str(record["audio"])
        caption = html.escape(f"{record.get('prompt', '')} (r={record.get('reward')}, {record['audio']})")
        if not inside_run(file, run_dir) or not file.is_file():
            parts.append(f'<p class="missing">not played: {html.escape(str(record["audio"]))} is missing or outside '
                         "the run directory</p>")
            continue
        data = base64.b64encode(file.read_bytes()).decode("ascii")
        parts.append(f'<figure><audio controls src="data:audio/wav;base64,{data}"></audio><figcaption>{caption}'
                     "</figcaption></figure>")
    return "\n".join(parts)
