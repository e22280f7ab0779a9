"""The run directory: the one place that knows its files, and checkpoints and resuming (docs/architecture.md).

    RUN_DIR/config.json          the run's config (resolved paths), written when the run starts
    RUN_DIR/metrics.jsonl        one JSON row per epoch (and one per final evaluation), flushed row by row
    RUN_DIR/checkpoints/checkpoint_N/   accelerator state (optimizer, RNG), the trainable weights in the
                                 family's format (lora/ or unet/ / transformer/), critic.safetensors,
                                 reference.safetensors / old_model.safetensors, trainer_state.json;
                                 with train.sharding="fsdp2": sharded/ (torch.distributed.checkpoint's
                                 .distcp files: model, optimizer, frozen copies), sharding.json, and in
                                 the final checkpoint the gathered weights (unet/ or transformer/, or lora/)
    RUN_DIR/stopped.json         a signal stopped the run before num_epochs (removed when it resumes)
    RUN_DIR/failed.json          the run stopped on an error (moved into resumes.jsonl when it resumes)
    RUN_DIR/resumes.jsonl        one row per resume that changed settings or input files, or followed a failure
    RUN_DIR/inputs.json          the sha256 of each file the run trains on (prompt files, reward files, edit sources),
                                 written when the run starts (none: no such file); a resume refuses a changed one
                                 (runs/inputs.py)
    RUN_DIR/.lock                held (fcntl) by the live run, removed when it ends
    RUN_DIR/.ddpo_group_run      this library's mark, written when the run starts, with the sha256 of the config.json
                                 it wrote: overwrite removes only a directory whose mark matches its config.json,
                                 and in it only what a run writes (RUN_ENTRIES; in samples/, checkpoints/ and
                                 debug/ only the names the run gives its files there, `_remove_run_entries`)
    RUN_DIR/finished.json        the run reached its end (num_epochs, final checkpoint); absent while it runs, and
                                 after a stop, a failure or a process that was killed or exited mid-run
    RUN_DIR/samples/, RUN_DIR/debug/, RUN_DIR/tensorboard/   sample grids, debug dumps, tracker files

A checkpoint is written into a temporary directory and renamed (atomic); a new run refuses a directory
that holds another run unless config.overwrite, which removes the earlier run's own files (never a directory
without the mark, never a file it did not write) while it holds the run's lock; config.run_name is one directory
name under config.logdir; a resumed run keeps its stored config except the fields
the user set and SAFE_RESUME_FIELDS allows (`resumed_config`).

Why one room of some 700 lines: every rule about what may be written, removed or resumed in a run directory (the
lock, the mark, the refusals, atomic and sharded checkpoints, the resume's config merge) reads the same list of
files above; split, a refusal could drift from the file list it protects.
"""

import contextlib
import datetime
import json
import logging
import os
import re
import shlex
import shutil
import zipfile

import ml_collections
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ddpo_group.config.fields import FREE_FORM_FIELDS, load_base_config
from ddpo_group.config.registry import ConfigError, check_positive, register_config_check
from ddpo_group.evaluation.hacking import gold_specs
from ddpo_group.report.inspect import read_metrics
from ddpo_group.data.prompts import BUILTIN_PROMPT_SETS
from ddpo_group.runs.inputs import INPUTS_FILE, check_inputs, input_hashes

logger = logging.getLogger("ddpo_group")

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
TRAINER_STATE = "trainer_state.json"
# Written into the run directory when a signal stopped the run before num_epochs; removed when it resumes.
STOPPED_FILE = "stopped.json"
FINISHED_FILE = "finished.json"
RUN_MARK = ".ddpo_group_run"
FAILED_FILE = "failed.json"
RESUMES_FILE = "resumes.jsonl"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CRITIC_FILE = "critic.safetensors"
# What writing a checkpoint raises when the disk or the file system fails: safetensors' own error (a full disk
# while it serializes, "No space left on device") besides OSError and torch's RuntimeError.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, or written; the message names the path and the fix."""


class RunDir:
    """The files of one run (module docstring). Resolved from the config without writing anything
    (`resolve`); `start` writes the run's config and markers once the run is accepted."""

    def __init__(self, path, resume_checkpoint=None, resume_state=None, resume_changes=None, input_changes=None):
        self.path = path
        self.resume_checkpoint = resume_checkpoint
        self.resume_state = resume_state
        self.resume_changes = resume_changes or {}
        self.input_changes = input_changes or {}  # {path: [recorded sha256, now]} the resume accepted
        self._lock = None

    @classmethod
    def resolve(cls, config, overrides=None):
        """(RunDir, the config the run trains with): a resumed run's stored config with the user's `overrides`
        (`resumed_config`), or a new run under config.logdir/config.run_name (refused when another run is
        there and config.overwrite is not set). Reads only."""
        config = with_resolved_paths(config)
        if config.resume_from and config.overwrite:
            raise ConfigError(
                f"config.resume_from={config.resume_from!r} and config.overwrite=True contradict each other (resume "
                "the run, or delete it and start again); drop --config.overwrite=True to resume, or drop "
                "--config.resume_from to start the run again"
            )
        if config.resume_from:
            checkpoint, state, path = find_checkpoint(config.resume_from)
            given = config.resume_from
            config, changes = resumed_config(config, path, overrides)
            with config.unlocked():  # a resume, whatever the stored config or an override list that omits these
                config.resume_from, config.overwrite = given, False
            # a changed prompt / reward file: refused, or recorded (a resume with nothing to do trains on nothing)
            input_changes = check_inputs(path, config) if int(state["epoch"]) < config.num_epochs else {}
            return cls(path, checkpoint, state, changes, input_changes), config
        _check_run_name(config.run_name)
        run_name = config.run_name or datetime.datetime.now().strftime("%Y.%m.%d_%H.%M.%S")
        path = os.path.abspath(os.path.join(config.logdir, run_name))
        _refuse_a_directory_not_a_run(path, config)
        _refuse_an_earlier_run(path, config.overwrite)
        return cls(path), config

    def file(self, name):
        return os.path.join(self.path, name)

    def lock(self):
        """Hold RUN_DIR/.lock (ConfigError when a live run holds it); kept until `release`."""
        if self._lock is None:
            self._lock = _lock_run_dir(self.path)

    def release(self):
        """Give up RUN_DIR/.lock and remove it: a finished run leaves no .lock behind (removed while still held, so
        no other run holds it; `_lock_run_dir` retries when the file it locked was removed meanwhile)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file(LOCK_FILE))
            self._lock.close()  # releases the run directory's lock
            self._lock = None

    def start(self, config, first_epoch, records=()):
        """Main process, once the run is accepted: create the directory with its mark (RUN_MARK), hold its lock
        (overwrite: then remove the earlier run's files, the lock held throughout so that a second overwrite is
        refused, not raced), write config.json and inputs.json (the hashes of the files it trains on; `records`:
        its prompt records, whose edit sources count); a resumed run is no longer stopped, and its earlier failure,
        changed settings and accepted input changes go into resumes.jsonl."""
        overwrite = config.overwrite and not config.resume_from and _holds_a_run(self.path)
        if overwrite:
            _refuse_an_earlier_run(self.path, True)  # only a directory this library marked as a run
        os.makedirs(self.path, exist_ok=True)
        self.lock()  # not while the earlier run is live; held from here to the run's end
        if overwrite:
            _remove_run_entries(self.path)
        write_json_atomic(self.file(CONFIG_FILE), config.to_dict())
        inputs = input_hashes(config, records)
        if inputs:  # a run on built-in prompts and registered rewards alone has no file to check
            write_json_atomic(self.file(INPUTS_FILE), {"files": inputs})
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.file(INPUTS_FILE))
        # the mark names the config.json its run wrote: a mark copied elsewhere proves nothing there
        mark = _read_mark(self.path)
        write_json_atomic(self.file(RUN_MARK), {
            "created_by": "ddpo_group", "time": mark.get("time") or datetime.datetime.now().isoformat(),
            "config_sha256": _sha256(self.file(CONFIG_FILE))})
        for name in (STOPPED_FILE, FINISHED_FILE):  # a run that goes on is no longer stopped, nor finished
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.file(name))
        previous_failure = None
        if self.resume_checkpoint and os.path.exists(self.file(FAILED_FILE)):
            # the run goes on: its earlier failure moves into resumes.jsonl, failed.json marks this attempt only
            with contextlib.suppress(OSError, ValueError):
                with open(self.file(FAILED_FILE)) as f:
                    previous_failure = json.load(f)
            previous_failure = previous_failure or {"error": "unreadable failed.json"}
        if self.resume_changes or previous_failure or self.input_changes:
            with open(self.file(RESUMES_FILE), "a") as f:
                record = {"epoch": first_epoch, "changed": self.resume_changes}
                if self.input_changes:
                    record["inputs_changed"] = self.input_changes
                if previous_failure:
                    record["previous_failure"] = previous_failure
                f.write(json.dumps(record, default=str) + "\n")
            if previous_failure:
                os.remove(self.file(FAILED_FILE))

    def append_metrics(self, row):
        """One row of metrics.jsonl, flushed to disk."""
        with open(self.file(METRICS_FILE), "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def mark_failed(self, epoch, err):
        """failed.json: a run that stopped on an error says so, and where; a finished.json of an earlier attempt
        (a finished run resumed for more epochs) goes, since the run has not reached its end (never raises)."""
        with contextlib.suppress(OSError):
            write_json_atomic(self.file(FAILED_FILE), {
                "epoch": epoch, "error": f"{type(err).__name__}: {err}", "time": datetime.datetime.now().isoformat(),
            })
        with contextlib.suppress(OSError):
            os.remove(self.file(FINISHED_FILE))

    def mark_finished(self, epoch, checkpoint):
        """finished.json: the run reached num_epochs and wrote its final checkpoint; the last file a run writes, so
        a run directory without it (and without failed.json / stopped.json) belongs to a process that is still
        running or was ended from outside (killed, os._exit in a reward)."""
        write_json_atomic(self.file(FINISHED_FILE), {
            "epoch": epoch, "checkpoint": checkpoint, "time": datetime.datetime.now().isoformat(),
        })

    def mark_stopped(self, epoch, signum):
        """stopped.json: a signal stopped the run before num_epochs, and how to resume it."""
        write_json_atomic(self.file(STOPPED_FILE), {
            "epoch": epoch, "signal": signum, "time": datetime.datetime.now().isoformat(),
            "resume": f"--config.resume_from={shlex.quote(self.path)}",  # pasted into a shell whole
        })

    def debug_path(self, epoch, rank):
        return os.path.join(self.path, "debug", f"epoch_{epoch:04d}_rank{rank}.json")

    def save_checkpoint(self, acc, epoch, state, weight_copies, limit=0, sharded=None, export=False):
        """checkpoints/checkpoint_{epoch}: accelerator.save_state (every process) into a temporary directory,
        then (main process) the weight copies (`weight_copies`: {file stem: holder with state_dict()}) and
        trainer_state.json = `state` + the copies' non-tensor state, an atomic rename, and pruning to the
        `limit` newest checkpoints (0: all kept). `sharded`: the ShardedState of train.sharding="fsdp2"
        (``save_sharded``; `export`: also the full weights). Returns the checkpoint's path."""
        root = os.path.join(self.path, "checkpoints")
        final = os.path.join(root, f"checkpoint_{epoch}")
        tmp = os.path.join(root, f".tmp_checkpoint_{epoch}")
        if acc.is_main_process:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        try:
            acc.save_state(tmp)
            if sharded is not None:
                save_sharded(tmp, sharded, export)
        except WRITE_ERRORS as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
        acc.wait_for_everyone()  # every rank's files are in tmp before it is renamed
        if acc.is_main_process:
            state = dict(state)
            for name, holder in weight_copies.items():
                copy_state = holder.state_dict()
                if copy_state["params"]:
                    try:
                        save_file(copy_state["params"], os.path.join(tmp, f"{name}.safetensors"))
                    except WRITE_ERRORS as err:
                        shutil.rmtree(tmp, ignore_errors=True)
                        raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
                state[name] = {k: v for k, v in copy_state.items() if k != "params"}
            try:
                write_json_atomic(os.path.join(tmp, TRAINER_STATE), state)
            except WRITE_ERRORS as err:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            _prune_checkpoints(root, limit)
            logger.info("checkpoint written: %s", final)
        acc.wait_for_everyone()
        return final

    def load_checkpoint(self, acc, weight_copies, sharded=None, truncate_metrics=True):
        """Load the resumed checkpoint: accelerator state, then each weight copy; on the main process drop the
        metrics rows of the epochs the run will redo (truncate_metrics=False: a run with nothing to do keeps
        them all). Returns the checkpoint's trainer_state.json."""
        checkpoint, state = self.resume_checkpoint, self.resume_state
        check_sharded_checkpoint(checkpoint, sharded)
        try:
            acc.load_state(checkpoint)
            if sharded is not None:
                load_sharded(checkpoint, sharded)
        except Exception as err:
            broken = _unreadable_checkpoint_file(checkpoint)
            if not broken and sharded is not None:
                from ddpo_group.training.sharding import unreadable_sharded_file

                broken = unreadable_sharded_file(checkpoint)
            if broken:
                raise CheckpointError(
                    f"could not load checkpoint {checkpoint}: {broken[0]} is unreadable ({broken[1]}); delete "
                    "this checkpoint or point config.resume_from at an earlier checkpoint_N"
                ) from err
            raise CheckpointError(
                f"could not load checkpoint {checkpoint}: {err}; delete it or point config.resume_from at an "
                "earlier checkpoint_N (was it written with the same use_lora / model settings?)"
            ) from err
        for name, holder in weight_copies.items():
            if name not in state:
                continue
            copy_state = dict(state[name])
            path = os.path.join(checkpoint, f"{name}.safetensors")
            try:
                if os.path.exists(path):
                    copy_state["params"] = load_file(path)
                holder.load_state_dict(copy_state)
            except Exception as err:
                raise CheckpointError(
                    f"could not load the {name.replace('_', ' ')} {path}: {err}; delete checkpoint {checkpoint} or "
                    "point config.resume_from at an earlier checkpoint_N"
                ) from err
        if acc.is_main_process and truncate_metrics:
            _truncate_metrics(self.file(METRICS_FILE), int(state["epoch"]))
        logger.info("resumed from %s at epoch %d", checkpoint, int(state["epoch"]))
        return state

    def register_model_files(self, acc, policy, trainable_module, critic_module, use_lora):
        """Accelerate's save / load hooks: the trainable module in its family's format (``policy.save_trainable``:
        lora/ in diffusers' format, or the whole model), the critic as critic.safetensors."""

        def save_hook(models, weights, output_dir):
            if acc.is_main_process:
                for model in models:
                    module = acc.unwrap_model(model)
                    if module is trainable_module:
                        policy.save_trainable(module, output_dir, use_lora)
                    elif module is critic_module:
                        save_file(module.state_dict(), os.path.join(output_dir, CRITIC_FILE))
            while weights:
                weights.pop()

        def load_hook(models, input_dir):
            while models:
                module = acc.unwrap_model(models.pop())
                if module is trainable_module:
                    policy.load_trainable(module, input_dir, use_lora)
                elif module is critic_module:
                    module.load_state_dict(load_file(os.path.join(input_dir, CRITIC_FILE)))

        acc.register_save_state_pre_hook(save_hook)
        acc.register_load_state_pre_hook(load_hook)


# ---- sharded checkpoints (train.sharding="fsdp2", ddpo_group/training/sharding.py) ---------------------------------------
# Kept in this block of its own: the sharded state is written and read by every process through
# torch.distributed.checkpoint (ShardedState.save / load), beside Accelerate's state of the same checkpoint.


def save_sharded(directory, sharded, export=False):
    """Every process writes its shards into directory/sharded/ (and rank 0 sharding.json); `export`: the full
    weights too (``ShardedState.export``: gathered onto rank 0 and written in the family's layout)."""
    sharded.save(directory)
    if export:
        sharded.export(directory)


def check_sharded_checkpoint(checkpoint, sharded):
    """CheckpointError in one line when the checkpoint's sharding and the run's differ."""
    from ddpo_group.training.sharding import SHARDED_META

    written_sharded = os.path.exists(os.path.join(checkpoint, SHARDED_META))
    if written_sharded and sharded is None:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written with train.sharding='fsdp2'; resume it with "
            "--config.train.sharding=fsdp2 (its full weights, in the final checkpoint, load unsharded)"
        )
    if sharded is not None and not written_sharded:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written with train.sharding='none'; resume it with train.sharding='none'"
        )


def load_sharded(checkpoint, sharded):
    """Every process reads its shards of checkpoint/sharded/ (DCP re-shards a checkpoint of another
    number of processes); logs when the number differs."""
    meta = sharded.load(checkpoint)
    import torch.distributed as dist

    if meta["num_processes"] != dist.get_world_size():
        logger.warning("checkpoint %s was written by %d processes, re-sharded onto %d", checkpoint,
                       meta["num_processes"], dist.get_world_size())


# ---- end of the sharded-checkpoint block -------------------------------------------------------------------------


def _prune_checkpoints(root, limit):
    """Keep the `limit` newest checkpoint_N directories of `root` (0: keep all)."""
    if not limit:
        return
    names = sorted((n for n in os.listdir(root) if CHECKPOINT_RE.match(n)), key=lambda n: int(CHECKPOINT_RE.match(n)[1]))
    for name in names[:-limit]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def find_checkpoint(path):
    """(checkpoint_N directory, its trainer state, the run directory) for config.resume_from = `path`.

    `path` is a checkpoint_N directory, or a run directory holding checkpoints/checkpoint_N (the
    trainer's layout) or checkpoint_N directly; the latest complete checkpoint is taken. The run
    directory is the one named (or the one above checkpoints/), never a parent of it.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"config.resume_from={path!r} is a file; give the run directory (logdir/run_name) or one "
                              "of its checkpoints/checkpoint_N directories")
    if not os.path.isdir(path):
        raise CheckpointError(f"config.resume_from={path!r} does not exist; give a run directory or a checkpoint_N")
    if CHECKPOINT_RE.match(os.path.basename(path)):
        candidates = [path]
        parent = os.path.dirname(path)
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    else:
        run_dir = path
        root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
        names = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)]
        candidates = [os.path.join(root, n) for n in sorted(names, key=lambda n: -int(CHECKPOINT_RE.match(n)[1]))]
    if not candidates:
        raise CheckpointError(f"config.resume_from={path!r} holds no checkpoint_N directory to resume from")
    checkpoint = candidates[0]
    state_path = os.path.join(checkpoint, TRAINER_STATE)
    try:
        with open(state_path) as f:
            state = json.load(f)
        int(state["epoch"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {checkpoint} is incomplete or corrupt ({state_path}: {err}); delete it or point "
            "config.resume_from at an earlier checkpoint_N"
        ) from err
    return checkpoint, state, run_dir


# Fields a resumed run may change: how long it runs and what it writes, not what it trains.
SAFE_RESUME_FIELDS = (
    "num_epochs", "save_freq", "num_checkpoint_limit", "log_images_every", "log_with", "project_name",
    "resume_from", "resume_allow_changes", "resume_allow_input_changes", "run_name", "logdir", "reward_workers", "reward_timeout", "debug_dump",
    "variant",  # a label (config/grpo.py's name): runs from before it was stored have none
    "overwrite",  # what a new run does to an earlier one in its directory; a resume always has it off
    "train.gradient_checkpointing",  # memory only: values, gradients and the on-policy ratio are unchanged
)


def _safe_to_change(field):
    """A field SAFE_RESUME_FIELDS allows to change on resume: itself, or a section it belongs to, is listed."""
    parts = field.split(".")
    return any(".".join(parts[:n]) in SAFE_RESUME_FIELDS for n in range(1, len(parts) + 1))


def _merge_stored(node, stored, top=True):
    """`stored` (a config.json dict) written into the default config `node` field by field: a field the run's
    config.json lacks (one added to the defaults after the run started) keeps its default, which is the
    behaviour the run had; a field the defaults no longer have is left out; the free-form sub-configs
    (reward_weights, reward_kwargs) are taken whole."""
    for key, value in stored.items():
        if key not in node:
            continue
        if isinstance(value, dict) and isinstance(node[key], ml_collections.ConfigDict) and not (
                top and key in FREE_FORM_FIELDS):
            _merge_stored(node[key], value, top=False)
        else:
            node[key] = ml_collections.ConfigDict(value, allow_dotted_keys=True) if isinstance(value, dict) else value


def _absolute(path):
    """`path` made absolute when it names an existing file or directory from here; anything else as given (a name
    the loader looks up elsewhere: a built-in set, a shipped asset, a registered reward, a hub model)."""
    return os.path.abspath(os.path.expanduser(path)) if path and os.path.exists(os.path.expanduser(path)) else path


def _absolute_spec(spec):
    """A 'path/to/file.py:function' spec (reward, prompt plugin) with its file made absolute; other specs as given."""
    if not isinstance(spec, str) or ":" not in spec or spec.startswith(("http://", "https://")):
        return spec
    target, attr = spec.rsplit(":", 1)
    if target.endswith(".py") or os.sep in target or "/" in target:
        return f"{_absolute(target)}:{attr}"
    return spec


def _offline_model(name):
    """Whether `name` is a model a family builds offline ("tiny-shapes", ...), which no local directory shadows."""
    from ddpo_group.diffusion.policy import FAMILIES  # only asked when a directory of that name exists here

    return any(name in cls.offline_models for cls in FAMILIES.values())


def with_resolved_paths(config):
    """A copy of `config` whose relative file paths are absolute (from the current directory), so that the run's
    config.json works from any directory (a resume from elsewhere, scripts/evaluate.py): prompt_fn / eval_prompt_fn
    files and prompt_fn_kwargs.path, 'file.py:function' specs (prompt_fn, reward_fn, eval_rewards, the keys of
    reward_weights and reward_kwargs), .py files of plugins, and pretrained.model when it is a local directory.
    Names (built-in prompt sets and shipped prompt files, registered rewards, modules, hub models, URLs) are kept
    as given. config.logdir and config.resume_from have '~' expanded to the user's home."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for field in ("logdir", "resume_from"):  # '~/runs' is the user's home, not a directory named '~' here
            if isinstance(config.get(field), str):
                config[field] = os.path.expanduser(config[field])
        for field in ("prompt_fn", "eval_prompt_fn"):
            value = config.get(field)
            if isinstance(value, str) and value not in BUILTIN_PROMPT_SETS and value != "from_file":
                config[field] = _absolute(value) if os.path.isfile(value) else _absolute_spec(value)
        if isinstance(config.prompt_fn_kwargs.get("path"), str):
            config.prompt_fn_kwargs.path = _absolute(config.prompt_fn_kwargs.path)
        config.reward_fn = _absolute_spec(config.reward_fn)
        if "eval_rewards" in config:
            config.eval_rewards = ",".join(_absolute_spec(spec) for spec in gold_specs(config.eval_rewards))
        for field in ("reward_weights", "reward_kwargs"):
            config[field] = ml_collections.ConfigDict(
                {_absolute_spec(spec): value for spec, value in config[field].to_dict().items()}, allow_dotted_keys=True)
        entries = [entry.strip() for entry in config.plugins.split(",") if entry.strip()]
        config.plugins = ",".join(_absolute(e) if e.endswith(".py") or os.sep in e or "/" in e else e for e in entries)
        if os.path.isdir(os.path.expanduser(config.pretrained.model)) and not _offline_model(config.pretrained.model):
            config.pretrained.model = _absolute(config.pretrained.model)
    return config


def _flat(d, prefix=""):
    """A nested config dict as {dotted field: value}; the free-form sub-configs (reward_weights, whose keys may hold
    dots) are one value each."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value and not (not prefix and key in FREE_FORM_FIELDS):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resumed_config(given, run_dir, overrides=None):
    """The config a resumed run trains with, and the fields it changes: {field: [stored, given]}.

    The run's stored config.json, with the user's values of the fields in `overrides` (None: every
    field). Changing a field outside SAFE_RESUME_FIELDS mixes two experiments in one run: refused,
    naming the fields, unless given.resume_allow_changes. Reads only; writes nothing.
    """
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot resume {run_dir}: its config {path} is missing or unreadable ({err})") from err
    base = load_base_config()
    with base.unlocked():
        _merge_stored(base, stored)
    stored_flat = _flat(json.loads(json.dumps(base.to_dict(), default=str)))
    given_flat = _flat(json.loads(json.dumps(given.to_dict(), default=str)))
    fields = given_flat.keys() if overrides is None else [f for f in given_flat if any(
        f == o or f.startswith(o + ".") or o.startswith(f + ".") for o in overrides)]
    changes = {f: [stored_flat.get(f), given_flat[f]] for f in fields if stored_flat.get(f) != given_flat[f]}
    experiment = [f for f in changes if not _safe_to_change(f)]
    if experiment and not given.resume_allow_changes:
        listed = ", ".join(f"{f} ({changes[f][0]!r} -> {changes[f][1]!r})" for f in experiment[:8])
        raise ConfigError(
            f"config.resume_from={given.resume_from!r}: the run {run_dir} was trained with other settings: {listed}; "
            "resume with the run's own config (give only --config.resume_from), start a new run, or set "
            "--config.resume_allow_changes=True to continue it with the new settings"
        )
    resumed = given if overrides is None else base
    if overrides is not None:
        with resumed.unlocked():
            for field in changes:
                node = resumed
                *parents, leaf = field.split(".")
                for part in parents:
                    node = node[part]
                node[leaf] = _get_path(given, field)
    return resumed, changes


def _get_path(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def write_json_atomic(path, obj):
    """`obj` as JSON at `path`: written to a temporary file, flushed to disk, then renamed over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")
LOCK_FILE = ".lock"


# What a run writes at the top of its directory (module docstring); overwrite removes these and nothing else.
RUN_ENTRIES = (CONFIG_FILE, METRICS_FILE, "checkpoints", STOPPED_FILE, FAILED_FILE, FINISHED_FILE, RESUMES_FILE,
               INPUTS_FILE, "samples", "debug", "tensorboard", "wandb")
_RUN_ENTRY_RE = re.compile(  # reports; temporary files of a writer that was killed (write_json_atomic, _truncate_metrics)
    r"^(report(_vs_.+)?\.html|(%s)\.tmp\d*)$" % "|".join(re.escape(n) for n in RUN_ENTRIES + (RUN_MARK,)))


def _holds_a_run(run_dir):
    return any(os.path.exists(os.path.join(run_dir, name)) for name in RUN_MARKERS)


# The longest directory name common file systems allow (ext4, xfs, btrfs, APFS, NTFS: 255 bytes; NAME_MAX).
NAME_MAX_BYTES = 255


def _check_run_name(run_name):
    """config.run_name is one directory name under config.logdir ('' for a timestamp): never a path, '.' or '..',
    and at most NAME_MAX_BYTES bytes."""
    if run_name and len(os.fsencode(run_name)) > NAME_MAX_BYTES:
        raise ConfigError(
            f"config.run_name={run_name[:40]!r}... is {len(os.fsencode(run_name))} bytes long; a directory name may "
            f"have at most {NAME_MAX_BYTES} bytes, so give a shorter config.run_name"
        )
    if run_name and (run_name in (".", "..") or os.path.basename(run_name) != run_name or "/" in run_name
                     or os.sep in run_name or (os.altsep and os.altsep in run_name) or "\0" in run_name):
        raise ConfigError(
            f"config.run_name={run_name!r} is not one directory name: the run is written to config.logdir/"
            "config.run_name, so give a plain name such as 'my_run' (no '/', not '.' or '..') and put the "
            "directories in config.logdir"
        )


def _marked_run_above(path):
    """The nearest directory above `path` (links resolved) that holds RUN_MARK, or None."""
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    while True:
        if os.path.isfile(os.path.join(parent, RUN_MARK)):
            return parent
        if os.path.dirname(parent) == parent:
            return None
        parent = os.path.dirname(parent)


def _refuse_a_directory_not_a_run(run_dir, config):
    """A new run writes only into a directory of its own: one that does not exist yet, is empty, or is a run
    (RUN_MARK, or an earlier run's files: `_refuse_an_earlier_run` decides); never into a user's non-empty directory
    (also through a link) nor inside another run's directory (whose overwrite would delete it)."""
    where = f"config.logdir={config.logdir!r} / config.run_name={config.run_name!r}"
    real = os.path.realpath(run_dir)
    shown = run_dir if real == run_dir else f"{run_dir} (a link to {real})"
    outer = _marked_run_above(run_dir)
    if outer is not None:
        raise ConfigError(
            f"{where}: {shown} lies inside the run directory {outer}, whose files a new run would mix with (and an "
            "overwrite of that run would delete); give a config.logdir outside every run directory"
        )
    if not os.path.isdir(run_dir) or _holds_a_run(run_dir):
        return
    try:
        # a run's mark (and lock) alone: a run that stopped before writing its config; a copied mark proves nothing
        entries = sorted(n for n in os.listdir(run_dir) if n not in (RUN_MARK, LOCK_FILE))
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {shown} ({err.strerror or err}); pick another config.run_name") from None
    if entries:
        why = (f"its {RUN_MARK} mark names no config.json there"
               if os.path.lexists(os.path.join(run_dir, RUN_MARK)) else f"no {RUN_MARK} mark")
        raise ConfigError(
            f"{where}: {shown} is not empty ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}) and is not "
            f"a ddpo-group run ({why}): a new run would mix its files with these; pick another "
            "config.run_name or config.logdir, or give an empty directory"
        )


def _refuse_an_earlier_run(run_dir, overwrite):
    """A new run may not write into a directory that holds another run (it would mix or overwrite its files), and
    overwrite may remove only a directory this library marked as a run (RUN_MARK)."""
    if not _holds_a_run(run_dir):
        return
    if not overwrite:
        raise ConfigError(
            f"{run_dir} already holds a run: resume it with --config.resume_from={run_dir}, pick another "
            "config.run_name, or pass --config.overwrite=True to delete it and start again"
        )
    if not os.path.isfile(os.path.join(run_dir, RUN_MARK)):
        raise ConfigError(
            f"config.overwrite=True refuses to delete {run_dir}: it holds "
            f"{', '.join(n for n in RUN_MARKERS if os.path.exists(os.path.join(run_dir, n)))} but not the mark "
            f"{RUN_MARK} that ddpo-group writes into the run directories it creates (not a run, or one written by "
            "an older version); pick another config.run_name or config.logdir, or delete it yourself"
        )
    if not _mark_matches_config(run_dir):
        raise ConfigError(
            f"config.overwrite=True refuses to delete {run_dir}: its mark {RUN_MARK} does not name the config.json "
            "there (a mark copied from another run, one written by an older version, or a config.json edited by "
            "hand), so the files a run wrote cannot be told from yours; pick another config.run_name or "
            "config.logdir, or delete it yourself"
        )


# The names a run gives its files inside its folders (grids.save_epoch_samples, RunDir.save_checkpoint,
# MetricsLog.dump_debug), with the temporaries of their atomic writes; anything else there is the user's.
_SAMPLE_FILE_RE = re.compile(r"^(epoch|eval)_\d{4,}\.(png|webp|json)$")
_SAMPLE_DIR_RE = re.compile(r"^(epoch|eval)_\d{4,}$")
_SAMPLE_IMAGE_RE = re.compile(r"^\d{3,}((_source)?\.(png|webp)|\.wav)$")  # a video's soundtrack: NNN.wav
_ATOMIC_TMP_RE = re.compile(r"^\..+\.\d+\.[0-9a-f]{32}\.tmp$")  # grids.atomic_write
_CHECKPOINT_DIR_RE = re.compile(r"^(\.tmp_)?checkpoint_\d+$")
_DEBUG_FILE_RE = re.compile(r"^epoch_\d{4,}_rank\d+\.json(\.tmp\d+)?$")


def _run_writes(folder, name, is_dir):
    """Whether `name` (a directory when is_dir) inside the run's `folder` (relative: "samples", "samples/epoch_0003",
    "checkpoints", "debug") is a name the run gives what it writes there; None: descend, judge its entries."""
    if folder == "samples":
        return None if is_dir and _SAMPLE_DIR_RE.match(name) else (
            not is_dir and bool(_SAMPLE_FILE_RE.match(name) or _ATOMIC_TMP_RE.match(name)))
    if folder.startswith("samples/"):
        return not is_dir and bool(_SAMPLE_IMAGE_RE.match(name) or _ATOMIC_TMP_RE.match(name))
    if folder == "checkpoints":
        return is_dir and bool(_CHECKPOINT_DIR_RE.match(name))  # a checkpoint is the run's as a whole
    if folder == "debug":
        return not is_dir and bool(_DEBUG_FILE_RE.match(name))
    return False


def _remove(path):
    """Remove a file, a link (never what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _remove_written(run_dir, folder, kept):
    """Remove what the run wrote inside run_dir/folder (`_run_writes`), the folder too once it is empty; append the
    others (paths relative to run_dir) to `kept`."""
    path = os.path.join(run_dir, folder)
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        is_dir = os.path.isdir(entry) and not os.path.islink(entry)
        verdict = _run_writes(folder, name, is_dir)
        if os.path.islink(entry) and (verdict or _run_writes(folder, name, True) is not False):
            # a link at a name the run writes: kept, the new run would write through it, outside the run directory;
            # the link goes (never what it points to)
            verdict = True
        if verdict is None:
            _remove_written(run_dir, f"{folder}/{name}", kept)
        elif verdict:
            _remove(entry)
        else:
            kept.append(f"{folder}/{name}")
    if not os.listdir(path):
        os.rmdir(path)


def _remove_run_entries(run_dir):
    """Remove what a run wrote into `run_dir` (RUN_ENTRIES, reports, temporary files; inside samples/, checkpoints/
    and debug/ only the names the run writes there, `_run_writes`; the trackers' tensorboard/ and wandb/ whole),
    keeping its lock and mark and every other file, named in one logged line: the caller holds the run's lock."""
    kept = []
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name in (LOCK_FILE, RUN_MARK):
            continue
        if name not in RUN_ENTRIES and not _RUN_ENTRY_RE.match(name):
            kept.append(name)
        elif name in ("samples", "checkpoints", "debug") and os.path.isdir(path) and not os.path.islink(path):
            _remove_written(run_dir, name, kept)
        else:
            _remove(path)
    if kept:
        more = f" and {len(kept) - 10} more" if len(kept) > 10 else ""
        logger.warning("overwrite: %s kept %s%s (not written by a run)", run_dir, ", ".join(kept[:10]), more)


def _sha256(path):
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read_mark(run_dir):
    """The run's mark as a dict ({} when absent or unreadable)."""
    try:
        with open(os.path.join(run_dir, RUN_MARK)) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return {}
    return mark if isinstance(mark, dict) else {}


def _mark_matches_config(run_dir):
    """Whether the mark names the config.json beside it (its sha256): the mark was written by the run whose files
    these are, not copied there, nor written by an older version that did not record it."""
    digest = _read_mark(run_dir).get("config_sha256")
    try:
        return isinstance(digest, str) and _sha256(os.path.join(run_dir, CONFIG_FILE)) == digest
    except OSError:
        return False


def _lock_run_dir(run_dir):
    """An exclusive lock on run_dir/.lock (released when the returned file is closed, or the process exits);
    ConfigError when another live run holds it. No-op where the platform has no fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return open(os.devnull, "w")
    path = os.path.join(run_dir, LOCK_FILE)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        while not os.path.exists(path) or os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino:
            # the run that held it ended and removed the file between our open and our lock: lock the new one
            handle.close()
            handle = open(path, "a+")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"{run_dir} is in use by a live run ({holder}); wait for it to end, or pick another config.run_name"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _unreadable_checkpoint_file(checkpoint):
    """(path, reason) of the first file of a checkpoint that cannot be read (a truncated or overwritten
    optimizer.bin, safetensors file or random state), or None; only asked after loading the checkpoint failed."""
    for root, _, names in sorted(os.walk(checkpoint)):
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                if name.endswith(".safetensors"):
                    with safe_open(path, "pt") as f:
                        for key in f.keys():
                            f.get_slice(key)
                elif name.endswith((".bin", ".pkl", ".pt", ".pth")):  # torch.save's zip format: CRCs, nothing unpickled
                    with zipfile.ZipFile(path) as archive:
                        damaged = archive.testzip()
                    if damaged:
                        raise ValueError(f"member {damaged} fails its CRC check")
            except Exception as err:  # any failure to read is the answer
                return path, " ".join(str(err).split())[:200] or type(err).__name__
    return None


def _checkpoint_write_error(root, final, err):
    """One line for a checkpoint that could not be written: the cause, free space, the checkpoint kept."""
    import errno

    try:
        free_mb = shutil.disk_usage(root).free / 2**20
    except OSError:
        free_mb = float("nan")
    full = (getattr(err, "errno", None) == errno.ENOSPC or "iostream error" in str(err) or free_mb < 64
            or "No space left on device" in str(err) or "StorageFull" in str(err))  # safetensors' message
    kept = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
    latest = max(kept, key=lambda n: int(CHECKPOINT_RE.match(n)[1])) if kept else None
    cause = f"the disk holding {root} is full ({free_mb:.0f} MB free)" if full else f"{type(err).__name__}: {err}"
    return (
        f"could not write checkpoint {final}: {cause}; "
        + (f"the last complete checkpoint {os.path.join(root, latest)} is kept" if latest else "no earlier checkpoint exists")
        + "; free space (or lower num_checkpoint_limit) and resume with --config.resume_from"
    )


def _truncate_metrics(path, first_epoch):
    """On resume, drop metrics rows of epochs that the resumed run will redo.

    A torn last line (cut off before its newline: a run killed while writing it) is dropped with a warning;
    any other bad line is a CheckpointError naming the file and the line (inspect.read_metrics' rule).
    """
    if not os.path.exists(path):
        return
    torn = []
    try:
        parsed = read_metrics(path, torn=torn)
    except ValueError as err:
        raise CheckpointError(f"{err}; repair or delete that line to resume") from err
    if torn:
        logger.warning("%s: dropping its torn last line %d (the run was killed while writing it)", path, torn[0])
    rows = [json.dumps(row) + "\n" for row in parsed if row.get("epoch", -1) < first_epoch]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


@register_config_check("run")
def check_run_dir_fields(config, machine):
    """config.save_freq and num_checkpoint_limit >= 0; config.logdir is a directory (or not there yet)."""
    check_positive(config.save_freq, "save_freq", allow_zero=True)
    check_positive(config.num_checkpoint_limit, "num_checkpoint_limit", allow_zero=True)
    logdir = os.path.expanduser(config.logdir)
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ConfigError(f"config.logdir={config.logdir!r} is a file; give a directory (created if missing)")
