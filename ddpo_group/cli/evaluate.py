"""Mean reward of a model (or a training checkpoint) over every prompt of a prompt set, with fixed noise.

`ddpo-group evaluate` (scripts/evaluate.py is the same command from a checkout):

    ddpo-group evaluate --model tiny-shapes --prompts shapes_squares.txt --images-per-prompt 4
    ddpo-group evaluate --checkpoint runs/NAME/checkpoints/checkpoint_60
    ddpo-group evaluate --checkpoint runs/NAME          # its latest checkpoint

An evaluation protocol (ddpo_group/evaluation/protocols.py) scores with a benchmark's own rules and writes its table:

    ddpo-group evaluate --protocol geneval --model tiny-shapes --prompts geneval_shapes_squares.jsonl \
        --protocol-option detector=shapes
    ddpo-group evaluate --protocol geneval --checkpoint runs/NAME   # the run's prompts and detector
    ddpo-group evaluate --protocol geneval --images GENEVAL_IMAGE_FOLDER --protocol-option detector=shapes
    ddpo-group evaluate --protocol geneval2 --prompts geneval2_data.jsonl --model MODEL \
        --protocol-option url=http://127.0.0.1:8000/v1          # GenEval 2, Soft-TIFA by a VQA judge

It prints the table (GenEval: per tag, overall, % correct images / prompts; GenEval 2: Soft-TIFA AM and GM, per skill
and per atomicity, ddpo_group/evaluation/geneval2.py) and writes it as JSON
(protocol_NAME.json beside a checkpoint, or --output) with the per-image results beside it (NAME_images.jsonl).

A checkpoint is read with the settings of its run (config.json beside checkpoints/): its prompts,
reward, steps, guidance, eta and evaluation seed and images per prompt, unless a flag says otherwise.
The evaluation is ddpo_group.evaluation.evaluator's, the one the trainer logs as eval/reward_mean: image j
of prompt i starts from the same noise in every evaluation, so two models compare directly.
Prints a summary and writes JSON (evaluation.json beside a checkpoint; a checkpoint that its live run pruned during
the evaluation: RUN_DIR/checkpoint_N_evaluation.json). --output is a new file or an earlier output of this script,
never a directory, another file or a run's own file (config.json, metrics.jsonl, ...), checked before any model
loads. Sampled images that are not finite (diverged weights) stop the evaluation with one line and write nothing;
--guidance-scale and --eta must be finite. Runs with one torch thread unless
OMP_NUM_THREADS says otherwise (as scripts/train.py does under accelerate launch). A bad input (a flag, a path, a
checkpoint, a prompt set, a reward) stops with one line naming it (DDPO_GROUP_DEBUG=1: the traceback). A batch's
reward may take --reward-timeout seconds (default: the run's config.reward_timeout, else the training default, 600;
0: no limit), past which the evaluation stops naming the reward: a reward that never returns (a judge endpoint that
hangs) does not hold it for ever.
"""

import argparse
import json
import math
import os
import re
import sys
import time

from ddpo_group.cli.common import OneLineArgumentParser, cpu_threads, debug, inside_package, one_line

PROG = "evaluate.py"  # the command's name in its messages (scripts/evaluate.py's); `ddpo-group evaluate` passes its own
CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


class EvaluateError(ValueError):
    """A bad input of this script (a path, a checkpoint, a flag value); the message names it and says what to do."""


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _finite_float(text):
    """A numeric flag (--guidance-scale, --eta): a finite number; NaN or inf would sample NaN images."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None  # argparse's own words
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _images_per_prompt(text):
    """--images-per-prompt: as the training config's eval_images_per_prompt, 1 to MAX_EVAL_IMAGES_PER_PROMPT."""
    from ddpo_group.evaluation.evaluator import MAX_EVAL_IMAGES_PER_PROMPT

    value = _positive_int(text)
    if value > MAX_EVAL_IMAGES_PER_PROMPT:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_EVAL_IMAGES_PER_PROMPT} (the training config's limit "
                                         f"on eval_images_per_prompt), got {text!r}")
    return value


def _seed(text):
    """--seed: as the training config's eval_seed, 0 to MAX_SEED."""
    from ddpo_group.config.fields import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2**31 - 1, got {text!r}")
    return value


def _seconds(text):
    """--reward-timeout: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def reward_timeout(args, run):
    """The seconds a batch's reward may take: --reward-timeout, else the run's config.reward_timeout, else the
    training config's default; None: no limit (0)."""
    from ddpo_group.config.fields import load_base_config

    if args.reward_timeout is not None:
        seconds = args.reward_timeout
    elif run.get("reward_timeout") is not None:
        seconds = run["reward_timeout"]
    else:
        seconds = load_base_config().reward_timeout
    return float(seconds) or None


def find_run_checkpoint(path):
    """(checkpoint_N directory, run directory, the run's config dict) for --checkpoint: a checkpoint_N directory, or a
    run directory (its latest checkpoint). EvaluateError naming the path and the fix otherwise."""
    given = path
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise EvaluateError(f"--checkpoint {given}: no such directory; give a checkpoint of a run, "
                            "RUN_DIR/checkpoints/checkpoint_N, or the run directory RUN_DIR (its latest checkpoint)")
    if not CHECKPOINT_RE.match(os.path.basename(path)):
        root = os.path.join(path, "checkpoints")
        names = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
        if not names:
            raise EvaluateError(f"--checkpoint {given}: neither a checkpoint_N directory nor a run directory with "
                                "checkpoints/checkpoint_N; give RUN_DIR/checkpoints/checkpoint_N")
        path = os.path.join(root, max(names, key=lambda n: int(CHECKPOINT_RE.match(n)[1])))
    run_dir = os.path.dirname(path)
    if os.path.basename(run_dir) == "checkpoints":
        run_dir = os.path.dirname(run_dir)
    config_path = os.path.join(run_dir, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
        _ = config["pretrained"]["model"], config["use_lora"]  # the fields this script needs
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EvaluateError(f"--checkpoint {given}: the run's settings {config_path} are missing or unreadable "
                            f"({type(err).__name__}: {err}); is it a checkpoint written by the trainer?") from None
    return path, run_dir, config


def _earlier_output(path):
    """Whether the existing file `path` is what this script writes: a summary JSON (a mean reward's or a
    protocol's), or a protocol's per-image results (NAME_images.jsonl); a new evaluation replaces it."""
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith("_images.jsonl"):
                row = json.loads(f.readline())
                return isinstance(row, dict) and {"prompt_index", "image_index"} <= set(row)
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(summary, dict) and {"model", "prompts"} <= set(summary)
            and ("mean" in summary or "protocol" in summary))


def check_output(output, protocol=False, prog=PROG):
    """--output, before any model loads: a file in an existing directory that is new or an earlier output of this
    script (replaced; with --protocol the per-image results file beside it too). Never a directory, another file,
    nor a run's own file (config.json, metrics.jsonl, ...: a run directory's entries). EvaluateError naming it."""
    from ddpo_group.evaluation.protocols import results_path
    from ddpo_group.runs.run_dir import RUN_ENTRIES, RUN_MARKERS

    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise EvaluateError(f"--output {output}: its directory does not exist; create it or write elsewhere")
    if os.path.isdir(output):
        raise EvaluateError(f"--output {output}: is a directory; give a file path, e.g. "
                            f"{os.path.join(output, 'evaluation.json')}")
    paths = [output] + ([results_path(output)] if protocol else [])
    for path in paths:
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.basename(path) in RUN_ENTRIES and any(os.path.exists(os.path.join(parent, n)) for n in RUN_MARKERS):
            raise EvaluateError(f"--output {output}: {path} is a file of the run in {parent}; write the evaluation "
                                "elsewhere (its default: evaluation.json beside the checkpoint)")
        if os.path.lexists(path) and (not os.path.isfile(path) or not _earlier_output(path)):
            raise EvaluateError(f"--output {output}: {path} exists and is not an earlier output of {prog}, which "
                                "would replace it; give a new path (or remove that file)")


def write_result(output, checkpoint, run_dir, name, write):
    """write(path) the result to --output, else beside the checkpoint as `name`; returns the path written. A
    checkpoint that a live run pruned during the evaluation leaves no directory to write into: the result goes to
    the run directory as checkpoint_N_<name> instead (EvaluateError when that is gone too)."""
    path = output or os.path.join(checkpoint, name)
    try:
        if output or os.path.isdir(checkpoint):
            write(path)
            return path
    except FileNotFoundError:
        if output:
            raise EvaluateError(f"--output {output}: its directory was removed during the evaluation; nothing was "
                                "written (the numbers are printed above)") from None
    if run_dir and os.path.isdir(run_dir):
        moved = os.path.join(run_dir, f"{os.path.basename(checkpoint)}_{name}")
        print(f"{checkpoint} was removed during the evaluation (the run pruned it): writing into the run directory")
        write(moved)
        return moved
    raise EvaluateError(f"checkpoint {checkpoint} and its run directory were removed during the evaluation: nothing "
                        "was written (the numbers are printed above); give --output PATH")


def load_checkpoint_policy(checkpoint, config):
    """The run's model with the checkpoint's trained weights (full weights or LoRA); `config`: the run's settings
    (find_run_checkpoint)."""
    from ddpo_group.diffusion.base import configure_from_sample
    from ddpo_group.diffusion.policy import load_policy

    policy = load_policy(config["pretrained"]["model"])
    configure_from_sample(policy, config.get("sample", {}))  # a field older runs lack: the default they ran with
    # two experts (Wan 2.2 A14B, docs/wan.md): the low-noise expert's guidance and the experts the run trained
    policy.configure_experts(config.get("sample", {}).get("guidance_scale_2", 0.0),
                             config.get("train", {}).get("experts", "both"))
    # LoRA: lora/ (the model's, or the high-noise expert's) and lora_2/ (the low-noise expert's), those written
    adapters = [name for name in ("lora", "lora_2") if os.path.isdir(os.path.join(checkpoint, name))]
    if config["use_lora"] and not adapters:
        raise EvaluateError(f"checkpoint {checkpoint} has no lora/ directory (the run trained LoRA weights): it is "
                            "incomplete; evaluate another checkpoint_N of the run")
    try:
        if config["use_lora"]:
            for name in adapters:
                extra = {"load_into_transformer_2": True} if name == "lora_2" else {}
                policy.pipeline.load_lora_weights(os.path.join(checkpoint, name), **extra)
        else:
            policy.load_trainable(policy.trainable_module, checkpoint, use_lora=False)
    except Exception as err:
        raise EvaluateError(f"could not load the trained weights of checkpoint {checkpoint} ({type(err).__name__}: "
                            f"{' '.join(str(err).split())[:300]}); evaluate another checkpoint_N of the run") from None
    return policy


def main(argv=None, prog=PROG):
    """Evaluates as the module docstring says; returns the summary written. `argv`: the arguments after the command
    (default sys.argv[1:]); `prog`: the command's name in its messages."""
    parser = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="model to evaluate (ignored with --checkpoint)")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint_N directory of a run, or a run directory (its latest checkpoint)")
    parser.add_argument("--prompts", default=None, help="prompt set (default: the run's eval/training prompts, or shapes)")
    parser.add_argument("--reward", default=None, help="reward (default: the run's, or shapes_alignment)")
    parser.add_argument("--images-per-prompt", type=_images_per_prompt, default=None, help="default: the run's, or 4")
    parser.add_argument("--num-steps", type=_positive_int, default=None, help="denoising steps (default: the run's, or 10)")
    parser.add_argument("--guidance-scale", type=_finite_float, default=None)
    parser.add_argument("--eta", type=_finite_float, default=None)
    parser.add_argument("--seed", type=_seed, default=None, help="noise seed (default: the run's eval_seed, or 1234)")
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--reward-timeout", type=_seconds, default=None,
                        help="seconds a batch's reward may take (default: the run's, or 600; 0: no limit)")
    parser.add_argument("--output", default=None, help="JSON file to write (default: beside the checkpoint, or print only)")
    parser.add_argument("--protocol", default=None,
                        help="an evaluation protocol (geneval, geneval2, ocr): its table and per-image results instead of a mean reward")
    parser.add_argument("--protocol-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument of the protocol's reward, e.g. detector=shapes (repeatable)")
    parser.add_argument("--images", default=None,
                        help="with --protocol: score the images of this folder in GenEval's layout instead of sampling")
    parser.add_argument("--save-images", default=None,
                        help="with --protocol: also write the sampled images in GenEval's layout (a new directory)")
    args = parser.parse_args(argv)
    args.prog = prog
    for option, path in (("--output", args.output), ("--save-images", args.save_images)):
        if path and inside_package(path, option):  # the package's shipped files are never written over
            raise EvaluateError(inside_package(path, option))
    if args.protocol:
        return evaluate_protocol(args)
    if args.protocol_option or args.images or args.save_images:
        raise EvaluateError("--protocol-option, --images and --save-images go with --protocol NAME")

    import torch

    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.evaluation.evaluator import evaluate
    from ddpo_group.data.prompts import load_prompts
    from ddpo_group.rewards import build_reward_fn
    from ddpo_group.runs.run_dir import write_json_atomic

    threads = cpu_threads()  # one thread per process (or $OMP_NUM_THREADS), as scripts/train.py under accelerate launch
    if args.output:
        check_output(args.output, prog=prog)
    run, checkpoint, run_dir = {}, None, None
    if args.checkpoint:
        checkpoint, run_dir, run = find_run_checkpoint(args.checkpoint)  # a bad path is named before any model loads
    sample = run.get("sample", {})
    # The run's evaluation prompts, else its training prompts (with their prompt_fn_kwargs), else the shapes set.
    prompts = args.prompts or run.get("eval_prompt_fn") or run.get("prompt_fn", "shapes")
    prompt_kwargs = (run.get("prompt_fn_kwargs") or {}) if prompts == run.get("prompt_fn") and not args.prompts else {}
    # The run's reward as the trainer built it (weights, kwargs, aggregation), unless --reward names another.
    reward = args.reward or run.get("reward_fn") or ("" if run.get("reward_weights") else "shapes_alignment")
    # Rewards and prompts first, as the trainer does: a bad one fails before any diffusion model loads.
    try:
        records = load_prompts(prompts, **prompt_kwargs)
    except (ValueError, OSError) as err:
        source = "--prompts" if args.prompts else ("the run's config.eval_prompt_fn" if run.get("eval_prompt_fn")
                                                   else "the run's config.prompt_fn")
        raise EvaluateError(f"{' '.join(str(err).split())} (from {source}; --prompts PATH evaluates other prompts)") from None
    frames = run.get("reward_frames", 4)  # on videos: the frames an image reward scores, as the run scored them
    if args.reward or not run:
        reward_fn = build_reward_fn(reward, reward_frames=frames)
    else:
        reward_fn = build_reward_fn(run.get("reward_fn") or None, run.get("reward_weights") or None,
                                    reward_kwargs=run.get("reward_kwargs") or None,
                                    reward_aggregation=run.get("reward_aggregation", "sum_then_normalize"),
                                    reward_frames=frames)
        reward = reward or "+".join(run.get("reward_weights") or {})
    reward_fn.check_ready()
    policy = load_checkpoint_policy(checkpoint, run) if checkpoint else load_policy(args.model)
    images_per_prompt = args.images_per_prompt or (run.get("eval_images_per_prompt") if run.get("eval_freq") else None) or 4
    num_steps = args.num_steps or sample.get("num_steps", 10)
    guidance = args.guidance_scale if args.guidance_scale is not None else sample.get("guidance_scale", 3.0)
    eta = args.eta if args.eta is not None else sample.get("eta", 1.0)
    seed = args.seed if args.seed is not None else run.get("eval_seed", 1234)
    start = time.perf_counter()
    with torch.no_grad():
        result = evaluate(policy, None, records, reward_fn, images_per_prompt, num_steps, guidance, eta, seed=seed,
                          batch_size=args.batch_size, reward_timeout=reward_timeout(args, run))
    per_prompt = result["per_prompt"]
    summary = {
        "model": checkpoint or args.model,
        "prompts": prompts,
        "reward": reward,
        "num_prompts": len(records),
        "images_per_prompt": images_per_prompt,
        "num_steps": num_steps,
        "guidance_scale": guidance,
        "eta": eta,
        "seed": seed,
        "mean": result["reward_mean"],
        "std": result["reward_std"],
        "components": result["components"],
        "fraction_of_prompts_at_least_0.9": float((per_prompt >= 0.9).mean()),
        "per_prompt": {r.prompt: float(v) for r, v in zip(records, per_prompt)},
        "seconds": time.perf_counter() - start,
        "torch_threads": threads,
    }
    print(
        f"{summary['model']}: mean {reward} {summary['mean']:.4f} over {len(records)} prompts x "
        f"{images_per_prompt} images ({summary['fraction_of_prompts_at_least_0.9']:.0%} of prompts >= 0.9), "
        f"{summary['seconds']:.0f} s"
    )
    if args.output or checkpoint:
        output = write_result(args.output, checkpoint, run_dir, "evaluation.json",
                              lambda path: write_json_atomic(path, summary))
        print(f"wrote {output}")
    return summary


def evaluate_protocol(args):
    """--protocol NAME: the protocol's records, models and images, its table printed and written (module docstring).
    Every input is checked (records, reward options, paths) before any model loads."""
    from ddpo_group.evaluation.geneval2 import GenEval2Error
    from ddpo_group.evaluation.protocols import ProtocolError
    from ddpo_group.rewards.geneval.metadata import GenEvalFormatError

    try:
        return _evaluate_protocol(args)
    except (ProtocolError, GenEvalFormatError, GenEval2Error) as err:
        message = " ".join(str(err).split())
        if "is not one the detector finds" in message and not any(
                option.replace(" ", "").startswith("detector=") for option in args.protocol_option):
            message += ("; the shapes and scenes worlds' prompt sets (geneval_scenes.jsonl, geneval_shapes*.jsonl) "
                        "are scored by their exact detector: add --protocol-option detector=shapes")
        raise EvaluateError(message) from None


def _evaluate_protocol(args):
    import torch

    from ddpo_group.evaluation.protocols import (
        check_new_folder,
        get_protocol,
        parse_options,
        read_geneval_folder,
        save_geneval_folder,
        score_folder,
        score_policy,
        write_protocol_results,
    )

    threads = cpu_threads()
    if args.output:
        check_output(args.output, protocol=True, prog=args.prog)
    if args.images and args.protocol == "geneval2":
        raise EvaluateError("--images reads GenEval's folder layout; --protocol geneval2 scores images it samples "
                            "(--model or --checkpoint, with --prompts geneval2_data.jsonl)")
    if args.images and (args.checkpoint or args.save_images):
        raise EvaluateError("--images scores images already made: it takes no --checkpoint or --save-images")
    if args.save_images:
        check_new_folder(args.save_images)  # before hours of sampling
    run, checkpoint, run_dir = {}, None, None
    if args.checkpoint:
        checkpoint, run_dir, run = find_run_checkpoint(args.checkpoint)
    options = {}
    if run.get("reward_fn") == args.protocol:  # the run's own detector and models, unless an option says otherwise
        options.update((run.get("reward_kwargs") or {}).get(args.protocol) or {})
    options.update(parse_options(args.protocol_option))
    # the protocol's models (a detector, a reward model) on the GPU when there is one
    protocol = get_protocol(args.protocol, device="cuda" if torch.cuda.is_available() else None, **options)
    sample = run.get("sample", {})
    if args.images:
        records, images = read_geneval_folder(args.images)
        prompts = args.images
    else:
        prompts = args.prompts or run.get("eval_prompt_fn") or run.get("prompt_fn")
        if not prompts:
            raise EvaluateError(f"--protocol {args.protocol} needs --prompts (for geneval: GenEval's "
                                "prompts/evaluation_metadata.jsonl) or a run's --checkpoint")
        prompt_kwargs = (run.get("prompt_fn_kwargs") or {}) if prompts == run.get("prompt_fn") and not args.prompts else {}
        records = protocol.load_records(prompts, prompt_kwargs)
    protocol.check_ready()
    images_per_prompt = args.images_per_prompt or protocol.images_per_prompt
    num_steps = args.num_steps or sample.get("num_steps", 10)
    guidance = args.guidance_scale if args.guidance_scale is not None else sample.get("guidance_scale", 3.0)
    eta = args.eta if args.eta is not None else sample.get("eta", 1.0)
    seed = args.seed if args.seed is not None else run.get("eval_seed", 1234)
    start = time.perf_counter()
    if args.images:
        results = score_folder(protocol, records, images, batch_size=args.batch_size)
        model, settings = args.images, {}
    else:
        from ddpo_group.diffusion.policy import load_policy  # the diffusion models: only when images are sampled

        policy = load_checkpoint_policy(checkpoint, run) if checkpoint else load_policy(args.model)
        with torch.no_grad():
            results, kept = score_policy(protocol, policy, records, images_per_prompt, num_steps, guidance, eta,
                                         seed=seed, batch_size=args.batch_size, keep_images=bool(args.save_images))
        if args.save_images:
            save_geneval_folder(args.save_images, records, kept)
        model = checkpoint or args.model
        settings = {"images_per_prompt": images_per_prompt, "num_steps": num_steps, "guidance_scale": guidance,
                    "eta": eta, "seed": seed}
    summary = {"protocol": args.protocol, "model": model, "prompts": prompts, "options": options, **settings,
               **protocol.summarize(results), "seconds": time.perf_counter() - start, "torch_threads": threads}
    print(f"{model}: protocol {args.protocol}, {len(records)} prompts")
    print(protocol.format(summary))
    if args.output or checkpoint:
        written = []
        output = write_result(args.output, checkpoint, run_dir, f"protocol_{args.protocol}.json",
                              lambda path: written.append(write_protocol_results(path, summary, results)))
        print(f"wrote {output} and {written[-1]}")
    return summary


def run(argv=None, prog=PROG):
    """main() with every error as one line (DDPO_GROUP_DEBUG=1: the traceback) and a non-zero exit."""
    try:
        return main(argv, prog=prog)
    except KeyboardInterrupt:
        sys.exit(f"{prog}: interrupted (Ctrl-C)")
    except Exception as err:
        if debug():
            raise
        sys.exit(f"{prog}: error: {err if isinstance(err, EvaluateError) else one_line(err)}")
