"""The tiny_* algorithm variants are the main job (`tiny`) with only their method's fields changed, so their
evaluations compare with the main job's; and the command the Configs table (docs/configs.md) gives for each measures
exactly it.

Each variant's changed fields are declared here by hand (what its name says), not read from the code: a field
changed in its module of ddpo_group/config/variants/ without being declared, or declared without being changed, fails."""

import os
import re
import shlex

import pytest
from helpers import load_script

from ddpo_group.config import grpo

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_KL = {"train.use_reference_model", "train.use_kl_loss", "train.beta"}
# variant -> the fields (dotted) in which it differs from tiny(): its method, nothing of the task.
DECLARED = {
    # DDPO: per-prompt stat tracking, no dual clip, no KL (ddpo-pytorch has none); the main job's lr
    "tiny_ddpo": {"algorithm.adv_estimator", "train.clip_ratio_c"} | NO_KL,
    # a critic and GAE instead of GRPO's group baseline; KL and lr as the main job
    "tiny_gae": {"algorithm.adv_estimator"},
    # the Group-PPO design that learns: noise (a 1-step SDE window at step 0) and training at the segment's first
    # step, per-prompt normalisation; lr 5e-5 from the Group-PPO study's sweep
    "tiny_group_ppo": {"algorithm.adv_estimator", "train.timestep_selection", "sample.sde_window_size",
                       "group_ppo.advantage_norm", "train.learning_rate"},
    # Algorithm 2 as written: endpoints, no reference model, segments of at most 8; lr 5e-5 from the sweep
    "tiny_group_ppo_alg2": {"algorithm.adv_estimator", "train.timestep_selection", "group_ppo.max_group_size",
                            "train.learning_rate"} | (NO_KL - {"train.beta"}),
    # tiny_group_ppo_alg2 with another trained step
    "tiny_group_ppo_sampled": {"algorithm.adv_estimator", "train.timestep_selection", "group_ppo.max_group_size",
                               "train.learning_rate"} | (NO_KL - {"train.beta"}),
    # the main job trained at the 2 noisiest steps (train.early_steps' default is 2)
    "tiny_early_window": {"train.timestep_selection"},
    # the main job with noise and training in a 4-step SDE window; lr 5e-5 from issue 35's sweep
    "tiny_window4": {"sample.sde_window_size", "train.learning_rate"},
    # forward-process objectives without KL; AWM's lr 1e-4 from its sweep
    "tiny_nft": {"train.objective", "forward.num_timesteps"} | NO_KL,
    "tiny_awm": {"train.objective", "forward.num_timesteps", "train.learning_rate"} | NO_KL,
    # Flow-DPPO's trust region / GRPO-Guard's normalised clip in place of PPO's clip; KL and lr as the main job
    "tiny_dppo": {"train.policy_loss"},
    "tiny_grpo_guard": {"train.policy_loss"},
    # the preference objectives: a frozen reference (no KL term on it), sampling with the policy (decay 0)
    "tiny_dgpo": {"train.objective", "forward.num_timesteps", "forward.old_decay_rate", "forward.old_decay_max",
                  "train.use_kl_loss", "train.beta", "train.learning_rate"},
    "tiny_dpo": {"train.objective", "forward.num_timesteps", "forward.old_decay_rate", "forward.old_decay_max",
                 "train.use_kl_loss", "train.beta"},
}
# issue 33's task presets: each is sd35 (Flow-GRPO's settings) with only its task's fields changed.
TASK_PRESETS = {
    "sd35_geneval": {"reward_fn", "reward_kwargs.geneval.detector", "reward_kwargs.geneval.jpeg_quality",
                     "reward_kwargs.geneval.score", "prompt_fn", "prompt_fn_kwargs.exclude", "prompt_fn_kwargs.n_per_tag",
                     "prompt_fn_kwargs.seed", "eval_freq", "save_freq"},
    "sd35_pickscore": {"reward_fn", "reward_kwargs.pickscore.divisor", "reward_kwargs.pickscore.preprocess",
                       "train.beta", "prompt_fn", "eval_prompt_fn", "eval_freq", "save_freq",
                       "eval_images_per_prompt"},
    # the OCR task (branch i33ocr): Flow-GRPO's general_ocr_sd3 differs from geneval_sd3 in its data and reward only
    "sd35_ocr": {"reward_fn", "reward_kwargs.ocr.engine", "prompt_fn", "eval_prompt_fn", "eval_images_per_prompt",
                 "eval_freq", "save_freq"},
}
# What makes an evaluation comparable with the main job's: no algorithm variant may change these (the SDE window of
# the Group-PPO design changes where the sampler's noise is, not its steps, guidance or noise level).
TASK_FIELDS = re.compile(
    r"^(prompt_fn.*|reward_.*|pretrained\..*|eval_.*|num_epochs|seed|mixed_precision|use_lora|"
    r"sample\.(?!sde_window_size$|sde_window_start$).*|"
    r"train\.(batch_size|gradient_accumulation_steps|num_inner_epochs|cfg))$")
# Fields of the method: a tiny_* variant that changes one of these is an algorithm variant and must be declared.
ALGORITHM_FIELDS = re.compile(
    r"^(algorithm\..*|group_ppo\..*|forward\..*|critic\..*|per_prompt_stat_tracking\..*|sample\.sde_window.*|"
    r"train\.(objective|timestep_selection|timestep_fraction|early_steps|use_kl_loss|beta|use_reference_model|"
    r"policy_loss|loss_agg_mode|clip_ratio_c|kl_type))$")
# The bench's run bookkeeping (benchmarks/bench_training.py build_method_config); everything else must be equal.
BOOKKEEPING = {"num_epochs", "logdir", "run_name", "log_images_every", "eval_freq", "save_freq", "log_with",
               "resume_from", "seed", "variant"}


def flat(config, prefix=""):
    out = {}
    for key, value in (config.to_dict() if hasattr(config, "to_dict") else config).items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def changed(a, b):
    return {key for key in set(a) | set(b) if a.get(key, KeyError) != b.get(key, KeyError)}


@pytest.mark.parametrize("variant", sorted(DECLARED))
def test_algorithm_variant_differs_from_tiny_only_in_its_declared_fields(variant):
    # `variant` is the name get_config records for the report, the one field that is not a setting.
    assert changed(flat(grpo.get_config(variant)), flat(grpo.tiny())) - {"variant"} == DECLARED[variant]


@pytest.mark.parametrize("variant", sorted(DECLARED))
def test_algorithm_variant_runs_the_main_jobs_task_and_evaluation(variant):
    config = grpo.get_config(variant)
    # the main job as README.md describes it: 18 big-square prompts, shapes_alignment, 40 epochs of 2 x 32
    # trajectories of 10 steps in groups of 8, fixed-noise evaluation of 8 images per prompt every 10 epochs
    assert config.pretrained.model == "tiny-shapes"
    assert config.prompt_fn == "shapes_big_squares.txt"
    assert config.reward_fn == "shapes_alignment"
    assert config.num_epochs == 40
    assert (config.sample.num_steps, config.sample.batch_size, config.sample.num_batches_per_epoch) == (10, 32, 2)
    assert config.sample.group_size == 8
    assert config.sample.guidance_scale == 3.0 and config.sample.eta == 1.0
    assert (config.eval_freq, config.eval_images_per_prompt, config.eval_seed) == (10, 8, 1234)


@pytest.mark.parametrize("preset", sorted(TASK_PRESETS))
def test_task_preset_differs_from_sd35_only_in_its_declared_fields(preset):
    assert changed(flat(grpo.get_config(preset)), flat(grpo.sd35())) - {"variant"} == TASK_PRESETS[preset]


def test_no_declared_field_is_part_of_the_task():
    for variant, fields in DECLARED.items():
        assert not [f for f in fields if TASK_FIELDS.match(f)], variant


def test_a_learning_rate_other_than_the_main_jobs_is_named_in_the_docstring():
    """A learning rate differs only where a measured sweep chose it, and the variant's docstring says which."""
    main_lr = grpo.tiny().train.learning_rate
    assert main_lr == 2e-4
    for variant in DECLARED:
        lr = grpo.get_config(variant).train.learning_rate
        if lr != main_lr:
            written = f"{lr:.0e}".replace("e-0", "e-")  # 5e-05 -> 5e-5
            assert written in grpo.VARIANTS[variant].__doc__, (variant, written)


# The scenes world's main jobs (docs/scenes.md): another task and model, with Flow-GRPO's recipe (tiny_scenes) and the
# main job's method on the UNet (tiny_scenes_sd); their methods are compared among themselves, not with tiny's.
SCENES_TASKS = {"tiny_scenes", "tiny_scenes_sd", "tiny_scenes_flow", "tiny_scenes_flow_nft"}
# A full-size preset's tiny twin that carries its preset's recipe (SDE window, KL), not the main job's method.
PRESET_TWINS = {"tiny_zimage_turbo"}
# A family's tiny pipeline with another policy loss (smoke runs of the loss on that family, not the main job's task).
FAMILY_LOSS_TWINS = {"tiny_sd3_dppo", "tiny_sd3_grpo_guard"}


def test_family_loss_twins_change_only_the_policy_loss():
    for name in FAMILY_LOSS_TWINS:
        loss = name.removeprefix("tiny_sd3_")
        assert changed(flat(grpo.get_config(name)), flat(grpo.tiny_sd3())) - {"variant"} == {"train.policy_loss"}
        assert grpo.get_config(name).train.policy_loss == loss


# A method's twin on the tiny flow family: tiny_sd3 with only the method's fields changed (tests and smoke runs).
SD3_TWINS = {
    "tiny_sd3_dgpo": {"train.objective", "forward.num_timesteps", "forward.old_decay_rate", "forward.old_decay_max",
                      "train.use_kl_loss", "train.beta", "sample.eta"},  # DGPO samples with the flow ODE (eta 0)
    "tiny_sd3_dpo": {"train.objective", "forward.num_timesteps", "forward.old_decay_rate", "forward.old_decay_max",
                     "train.use_kl_loss", "train.beta"},
}


@pytest.mark.parametrize("variant", sorted(SD3_TWINS))
def test_a_tiny_sd3_twin_differs_from_tiny_sd3_only_in_its_methods_fields(variant):
    assert changed(flat(grpo.get_config(variant)), flat(grpo.tiny_sd3())) - {"variant"} == SD3_TWINS[variant]


def test_every_tiny_variant_that_changes_the_method_is_declared():
    tiny = flat(grpo.tiny())
    for name in grpo.VARIANTS:
        if name.startswith("tiny_") and name not in DECLARED and name not in SCENES_TASKS | PRESET_TWINS | FAMILY_LOSS_TWINS | set(SD3_TWINS):
            method_changes = [f for f in changed(flat(grpo.get_config(name)), tiny) if ALGORITHM_FIELDS.match(f)]
            assert not method_changes, f"{name} changes {method_changes}: declare it in DECLARED"


def _load_bench():
    return load_script("benchmarks/bench_training.py")


def configs_table_commands():
    """{variant: bench_training.py arguments} from the rows of the Configs table (docs/configs.md) that give one."""
    with open(os.path.join(REPO_ROOT, "docs", "configs.md")) as f:
        text = f.read()
    prefix = re.search(r"`\.venv/bin/python benchmarks/bench_training\.py ([^`]*) ARGS`", text)
    assert prefix, "docs/configs.md: the common bench_training.py command of the Configs table (`... ARGS`)"
    commands = {}
    for row in re.findall(r"^\| `(tiny_\w+)` \|.*`(--common-variant [^`]*)`.*\|$", text, flags=re.M):
        commands[row[0]] = shlex.split(prefix.group(1)) + shlex.split(row[1])
    return commands


def test_the_configs_table_gives_every_algorithm_variant_a_command_that_trains_exactly_it(tmp_path):
    bench = _load_bench()
    commands = configs_table_commands()
    assert set(DECLARED) <= set(commands)
    for variant in sorted(DECLARED):
        args = bench.parse_args(commands[variant])
        assert (args.seeds, args.seed_start, args.epochs, args.eval_freq, args.jobs) == (3, 42, 40, 5, 1)
        assert len(args.methods) == 1 and args.model == "tiny-shapes"
        assert bench.parse_method_spec(args.methods[0])[0] == variant  # the label the results table shows
        built = bench.build_method_config(args.methods[0], args.model, args.epochs, str(tmp_path / "run"), args.reward,
                                          bench._sample_overrides(args), args.common_variant, seed=42,
                                          eval_freq=args.eval_freq)
        differ = changed(flat(built), flat(grpo.get_config(variant)))
        assert differ <= BOOKKEEPING, (variant, differ - BOOKKEEPING)
        assert (built.num_epochs, built.eval_freq, built.seed) == (40, 5, 42)


# ---- task variants: the main job's model and method on another task (issue 33). Each declares the task fields it
# changes from tiny(); no method field may change (test_every_tiny_variant_that_changes_the_method_is_declared).
TASK_DECLARED = {
    # GenEval records of the 36 square prompts, the geneval reward (partial score) with the exact shapes detector,
    # 4 evaluation images per prompt (GenEval's number)
    "tiny_geneval": {"prompt_fn", "reward_fn", "reward_kwargs.geneval.detector", "reward_kwargs.geneval.score",
                     "eval_images_per_prompt"},
}


@pytest.mark.parametrize("variant", sorted(TASK_DECLARED))
def test_task_variant_differs_from_tiny_only_in_its_declared_task_fields(variant):
    differ = changed(flat(grpo.get_config(variant)), flat(grpo.tiny())) - {"variant"}
    assert differ == TASK_DECLARED[variant]
    assert all(TASK_FIELDS.match(field) for field in differ)


@pytest.mark.parametrize("variant,model", [("tiny_scenes", "tiny-scenes-sd3"), ("tiny_scenes_sd", "tiny-scenes"),
                                           ("tiny_scenes_flow", "tiny-scenes-flow")])
def test_scenes_main_jobs_train_on_generated_prompts_and_evaluate_on_the_held_out_set(variant, model):
    config = grpo.get_config(variant)
    assert config.pretrained.model == model
    assert config.reward_fn == "geneval" and dict(config.reward_kwargs["geneval"]) == {"detector": "shapes",
                                                                                        "score": "partial"}
    assert config.prompt_fn == "ddpo_group.data.scenes:scene_training_prompts"
    assert config.eval_prompt_fn == "geneval_scenes.jsonl" and config.eval_freq > 0
    # the two differ only by the model and what its family samples and trains with
    flow, unet = flat(grpo.get_config("tiny_scenes")), flat(grpo.get_config("tiny_scenes_sd"))
    assert changed(unet, flow) - {"variant"} == {
        "pretrained.model", "sample.eta", "sample.sde_type", "sample.guidance_scale", "sample.max_sequence_length",
        "sample.resolution", "train.kl_type", "train.beta", "train.skip_last_steps"}
    # the flow-matching UNet keeps the flow model's recipe whole: only the model and its CLIP prompt length differ
    assert changed(flat(grpo.get_config("tiny_scenes_flow")), flow) - {"variant"} == {
        "pretrained.model", "sample.max_sequence_length"}


def test_tiny_scenes_flow_nft_is_tiny_scenes_flow_with_the_ladders_diffusion_nft_kl_recipe_only():
    """The ladder's DiffusionNFT + KL recipe (docs/scenes.md: the twelve --set options of its flow runs) as a named
    variant: tiny_scenes_flow's task, sampler and evaluation, only the method's fields changed, to these values."""
    config = grpo.get_config("tiny_scenes_flow_nft")
    recipe = {"train.objective": "nft", "forward.num_timesteps": 9, "forward.nft_beta": 1.0,
              "forward.weighting": "uniform", "forward.old_decay_rate": 0.001, "forward.old_decay_max": 0.5,
              "train.skip_last_steps": 0, "train.use_reference_model": True, "train.use_kl_loss": True,
              "train.beta": 0.1, "train.cfg": False, "train.num_inner_epochs": 4}
    got = flat(config)
    assert {k: got[k] for k in recipe} == recipe
    flow = flat(grpo.get_config("tiny_scenes_flow"))
    assert changed(got, flow) - {"variant"} <= set(recipe)
    assert config.pretrained.model == "tiny-scenes-flow" and config.sample.guidance_scale == 4.5
    # the study's nft_kl arm is the same recipe
    study = flat(load_script("benchmarks/scenes_study.py").method_config("nft_kl", 42, "/tmp/unused_run",
                                                                           flow_model="tiny-scenes-flow"))
    assert {k: study[k] for k in recipe} == recipe


# ---- where the variants live: ddpo_group/config/variants/, one module per purpose; grpo.py only assembles them
VARIANTS_DIR = os.path.join(REPO_ROOT, "ddpo_group", "config", "variants")


def _variant_modules():
    """{module name: (its docstring, the names of the functions it defines at top level)} of config/variants/."""
    import ast

    modules = {}
    for filename in sorted(os.listdir(VARIANTS_DIR)):
        if filename.endswith(".py") and filename != "__init__.py":
            with open(os.path.join(VARIANTS_DIR, filename)) as f:
                tree = ast.parse(f.read())
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            modules[f"ddpo_group.config.variants.{filename[:-3]}"] = (ast.get_docstring(tree) or "", defined)
    return modules


def test_every_variant_is_a_function_defined_in_exactly_one_variants_module():
    modules = _variant_modules()
    for name, variant in grpo.VARIANTS.items():
        assert callable(variant) and variant.__name__ == name, name
        defined_in = [module for module, (_, defined) in modules.items() if name in defined]
        assert defined_in == [variant.__module__], (name, defined_in, variant.__module__)
        assert getattr(grpo, name) is variant  # grpo.tiny(), grpo.sd35() read as before the split


def test_each_variants_module_says_its_purpose_and_names_its_variants_in_the_package_docstring():
    from ddpo_group.config import variants

    modules = _variant_modules()
    assert set(modules) >= {f"ddpo_group.config.variants.{m}" for m in ("tiny", "sd", "flow", "tasks", "video_edit")}
    for module, (docstring, defined) in modules.items():
        assert len(docstring.split()) >= 10, f"{module}: its docstring says what purpose it holds"
        assert f"{module.rpartition('.')[2]}.py" in variants.__doc__, f"{module}: listed in variants/__init__.py"
        public = {name for name in defined if not name.startswith("_")}
        assert public <= set(grpo.VARIANTS), f"{module} defines {public - set(grpo.VARIANTS)}: add them to VARIANTS"
        with open(os.path.join(VARIANTS_DIR, module.rpartition(".")[2] + ".py")) as f:
            assert len(f.read().splitlines()) < 600, f"{module}: over 600 lines, split it by purpose"
