"""Every configuration field of ddpo-group with its default, documented beside it.

This file lives inside the package (so that an installed copy trains from any directory);
`config/base.py` and `config/grpo.py` of a checkout are the user-facing entry points and read
it. Variants in `ddpo_group/config/grpo.py` start from `get_config()` here and change a few
fields; override any field on the command line:

    accelerate launch scripts/train.py --config config/grpo.py:tiny --config.train.beta=0.01

Field names follow ddpo-pytorch where it has one (sample.*, train.*, prompt_fn, reward_fn,
per_prompt_stat_tracking.*), so that its users feel at home. `ddpo_group.config.check`
validates a config before any model loads.
"""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()

    ###### General ######
    # Name of the run: outputs go to logdir/run_name/. Empty: a timestamp is used.
    config.run_name = ""
    # The built-in variant this config came from (set by ddpo_group/config/grpo.py's get_config; "" for a config
    # file of your own). A label kept in the run's config.json for the report's headline; it changes nothing.
    config.variant = ""
    # A run directory belongs to one run: starting a new run (not a resume) in one that already holds a run is
    # refused, unless overwrite=True, which deletes the earlier run's files first. A live run locks its directory.
    config.overwrite = False
    # Random seed; every process derives its own seeds from it, runs are reproducible on one machine.
    config.seed = 42
    # Top-level directory of runs (metrics.jsonl, sample grids, checkpoints).
    config.logdir = "logs"
    # Number of epochs. An epoch = sample, reward, advantages, `train.num_inner_epochs` passes of training.
    config.num_epochs = 100
    # Save a checkpoint every this many epochs (0: only at the end and on interruption).
    config.save_freq = 20
    # Keep at most this many checkpoints (oldest deleted first; 0: keep all).
    config.num_checkpoint_limit = 5
    # Mixed precision of the model calls: "no" (float32, the CPU default), "fp16" (GPU only) or "bf16"
    # (GPU, or CPU autocast). The step math and log-probs are float32 whatever this says.
    config.mixed_precision = "no"
    # Allow TF32 matmuls on Ampere+ GPUs (ignored on CPU).
    config.allow_tf32 = True
    # torch.compile the denoiser (the trainable UNet / transformer, with its LoRA adapters) for sampling, the old-log-prob
    # pass, the reference forward and training (ddpo_group/training/speed.py): compiled in place, so checkpoints and
    # LoRA exports keep their keys; the on-policy ratio stays exactly 1. Compiling costs minutes once per run (a graph
    # per grad mode and input shape); whether it pays: docs/performance.md. Not with train.sharding="fsdp2".
    config.compile = False
    # The attention kernel of the denoiser: "" (the library's default: torch's SDPA picks one) or a diffusers attention
    # backend ("native", "_native_flash", "_native_efficient", "_native_math", "_native_cudnn", "flash" (flash-attn),
    # "_flash_3" (FlashAttention 3), "sage", ...; diffusers' AttentionBackendName). It applies to the families whose
    # transformer dispatches through diffusers (FLUX, FLUX.2, Qwen-Image, Wan, Z-Image, LTX-2, HunyuanVideo 1.5), not
    # to SD 1.x / SDXL UNets or SD3, which call SDPA directly; GPU-only kernels are refused on a CPU machine.
    config.attention_backend = ""
    # Resume from a run directory (its latest complete checkpoint) or a checkpoint_N directory. The run's
    # stored config.json is used; overrides of how long it runs or what it logs (num_epochs, save_freq, ...)
    # are applied and recorded in resumes.jsonl, others are refused unless resume_allow_changes.
    config.resume_from = ""
    # Let a resumed run continue with changed training settings (two experiments in one run: use with care).
    config.resume_allow_changes = False
    # Let a resumed run continue although a file it trained on (a prompt file, a reward's .py or reference file, an edit
    # source) changed since it started (its sha256 in RUN_DIR/inputs.json); the change is recorded in resumes.jsonl.
    config.resume_allow_input_changes = False
    # Train LoRA adapters (peft) instead of the full UNet. The reference model is then nearly free.
    config.use_lora = True
    # LoRA rank and alpha (alpha 0: equal to the rank, scaling 1).
    config.lora_rank = 4
    config.lora_alpha = 0
    # Write a sample grid (samples/epoch_XXXX.png) every this many epochs (0: never).
    config.log_images_every = 1
    # Experiment tracker: "none", "wandb" (offline unless WANDB_MODE says otherwise and a network is there) or "tensorboard".
    config.log_with = "none"
    # Project name for wandb / tensorboard.
    config.project_name = "ddpo-group"
    # Evaluation with fixed noise (ddpo_group/evaluation/evaluator.py): every eval_freq epochs (0: never), before the
    # first update (logged on the epoch-0 row as eval/reward_mean, eval/reward_std, eval/<reward>) and once
    # more after the last epoch (a row of its own with epoch = num_epochs). Two evaluations differ only by
    # the weights: image j of prompt i always starts from the same noise.
    config.eval_freq = 0
    # Prompt set of the evaluation, as prompt_fn ("": the training prompts).
    config.eval_prompt_fn = ""
    # Images per prompt of an evaluation.
    config.eval_images_per_prompt = 2
    # Seed of the evaluation noise.
    config.eval_seed = 1234
    # Images per sampling call of an evaluation (0: sample.batch_size).
    config.eval_batch_size = 0
    # Prompts shown in the fixed evaluation grid samples/eval_XXXX.png (0: no grid).
    config.eval_grid_prompts = 8
    # Evaluation-only ("gold") rewards, the reward-hacking monitor: comma-separated reward specs in reward_fn's
    # forms (registered name, entry point, "package.module:function", "path/to/file.py:function", "http://host:port"),
    # e.g. "shapes_alignment" or "aesthetic,clip_score". Each evaluation also scores its images with each of them
    # (eval/gold/<name>_mean, eval/gold/<name>_std; the training reward stays eval/reward_mean) and flags
    # eval/gold/<name>_diverged = 1 when the training reward has risen while that gold reward fell (the rule:
    # ddpo_group/evaluation/hacking.py); the console says so once and the report draws both. They never train; they take no
    # keyword arguments (wrap one in a file.py:function for that). Needs eval_freq > 0.
    config.eval_rewards = ""
    # Write each rank's rewards, prompt ids and advantages to run_dir/debug/ every epoch (tests, debugging).
    config.debug_dump = False
    # Plugins imported before the config is checked: comma-separated module names or .py paths that
    # register an advantage estimator, a policy loss or a reward, then selected by name (ddpo_group/config/plugins.py).
    config.plugins = ""

    ###### Pretrained model ######
    config.pretrained = pretrained = ml_collections.ConfigDict()
    # "tiny-shapes" (shipped offline shapes-world model), "tiny" (random tiny weights, tests),
    # a local diffusers directory, or a hub id such as "stable-diffusion-v1-5/stable-diffusion-v1-5".
    pretrained.model = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    # Hub revision (branch, tag or commit); empty for the default.
    pretrained.revision = ""

    ###### Sampling ######
    config.sample = sample = ml_collections.ConfigDict()
    # Number of DDIM denoising steps T (the "tokens" of a trajectory).
    sample.num_steps = 50
    # DDIM eta (or a flow model's noise level): 0 is deterministic (no log-probabilities); 1.0 is DDPM-like.
    # RL needs eta > 0.
    sample.eta = 1.0
    # Classifier-free guidance scale (1.0: no guidance, no negative prompt pass).
    sample.guidance_scale = 5.0
    # A model with two experts (Wan 2.2 A14B): the guidance scale of the low-noise expert (0: sample.guidance_scale,
    # the pipeline's default). Any other model refuses a value other than 0.
    sample.guidance_scale_2 = 0.0
    # Trajectories sampled per process per sampling batch.
    sample.batch_size = 8
    # Sampling batches per epoch; an epoch has batch_size * num_batches_per_epoch * num_processes trajectories.
    sample.num_batches_per_epoch = 4
    # Images per prompt (the GRPO group). Must divide sample.batch_size * num_processes.
    sample.group_size = 8
    # Negative prompt for classifier-free guidance.
    sample.negative_prompt = ""
    # Image side in pixels; 0: the model's default size.
    sample.resolution = 0
    # Video models (Wan): frames per video (1 + 4k for Wan); 0: the model's default. Image models take only 0.
    sample.num_frames = 0
    # Flow-matching models (SD3, FLUX): the SDE of the stochastic steps, "sde" (Flow-GRPO), "cps"
    # (coefficients-preserving sampling, eta <= 1) or "dance" (DanceGRPO); "" is "sde" there and the only
    # value for SD 1.x/2.x (DDIM). For flow models sample.eta is the noise level a of these steps.
    sample.sde_type = ""
    # ODE/SDE window (Flow-GRPO-Fast, MixGRPO): only sde_window_size consecutive steps are stochastic and
    # trained; the others are deterministic ODE steps (eta 0, mask 0, never trained). 0: every step.
    sample.sde_window_size = 0
    # "fixed" (steps sde_window_start ... + size - 1), "random" (a new start each epoch, the same on every
    # process) or "sliding" (the start moves one step later every sde_window_shift_every epochs, wrapping).
    sample.sde_window = "fixed"
    sample.sde_window_start = 0
    sample.sde_window_shift_every = 1
    # The initial noise of a prompt's group (docs/critic.md): "independent" (each trajectory its own) or "shared"
    # (TempFlow-GRPO's seed groups: every trajectory of a prompt in an epoch starts from the same noise, so the only
    # spread inside a group is the stochastic steps' noise). With an SDE window and ODE steps before it, a group's
    # trajectories are one trajectory up to the window and branch there (TempFlow-style branching at the window's
    # start; sde_window="random" branches at a new step each epoch). The shared prefix is still computed once per
    # trajectory (no model calls saved).
    sample.group_noise = "independent"
    # sde_type="cps" only: the log-probability of a step (docs/flow.md). "normalized" (the Gaussian
    # log-density per dimension, as every other step) or "flow_grpo" (FlowCPS / Flow-GRPO's cps form,
    # -mean (x' - mean)^2: constants and 1 / (2 std^2) dropped, so its log-ratios, which the PPO clip cuts,
    # are 2 std^2 times the normalised ones; its ratio equals Flow-GRPO's on the same inputs).
    sample.cps_log_prob = "normalized"
    # Flow-matching models: the sigma grid of a trajectory. "pipeline" (the pipeline's own, with the model's
    # shift: Flow-GRPO) or "dance" (DanceGRPO's: t = linspace(1, 0, num_steps + 1), then sigma =
    # s t / (1 + (s - 1) t) with s = flow_grid_shift; DanceGRPO's FLUX script uses 3). Re-scoring reads the
    # grid each trajectory carries (Trajectories.sigmas).
    sample.flow_grid = "pipeline"
    sample.flow_grid_shift = 3.0
    # Text tokens of a T5 text encoder (SD3, FLUX); 0: the family's default (SD3 256, FLUX 512).
    sample.max_sequence_length = 0
    # Text-embedding cache (ddpo_group/diffusion/text_cache.py): the text conditioning of at most this many prompts is
    # kept (LRU, on the model's device), and a sampling batch whose prompts it all holds is not re-encoded. Exact: the
    # rows equal the uncached encoding's bit for bit (a batch with any new prompt is encoded whole, as without the
    # cache; the key holds the batch size). Bypassed where it would not be exact: a trained text encoder, Qwen-Image
    # (pads to the batch's longest prompt), the editing families whose text encoder reads the image. Counted in
    # prompts: a GRPO run's prompt set is what repeats. 0: off. Memory per prompt: its rows of every field, e.g.
    # SD3 with T5 (333 x 4096) ~2.7 MB in bf16, FLUX.1 (512 x 4096) ~4 MB; the tiny models a few KB.
    sample.text_embedding_cache = 256

    ###### Training ######
    config.train = train = ml_collections.ConfigDict()
    # Trajectories per training micro-batch (per process).
    train.batch_size = 4
    # Gradient (activation) checkpointing of the denoising model (diffusers' enable_gradient_checkpointing):
    # the training forward keeps only each block's inputs and recomputes the block in the backward, for
    # less memory (docs/memory.md) at the cost of about one more forward per trained step. Values and
    # the exact on-policy ratio are unchanged.
    train.gradient_checkpointing = False
    # A model with two experts (Wan 2.2 A14B): which ones train, "both", "high" (the high-noise expert, before the
    # boundary timestep) or "low"; LoRA and the optimizer cover only these. Any other model takes only "both".
    train.experts = "both"
    # Sharding of a full fine-tune over the processes (docs/sharding.md): "none" (DDP: every process holds the
    # whole model, its reference copy and its optimizer state) or "fsdp2" (torch's fully_shard: each block of
    # the model its own unit, parameters / gradients / optimizer state 1/N per process, computed in bf16 under
    # mixed_precision="bf16"). sharding_cpu_offload keeps the shards and the optimizer state in CPU memory.
    train.sharding = "none"
    train.sharding_cpu_offload = False
    # Use bitsandbytes' 8-bit Adam (GPU only; needs `pip install bitsandbytes`).
    train.use_8bit_adam = False
    # AdamW hyper-parameters.
    train.learning_rate = 3e-4
    train.adam_beta1 = 0.9
    train.adam_beta2 = 0.999
    train.adam_weight_decay = 1e-4
    train.adam_epsilon = 1e-8
    # Linear warm-up of the policy's learning rate over this many optimizer steps (0: none): optimizer step k
    # (counted from 0 over the whole run, resumes included) uses learning_rate x min(1, (k + 1) / lr_warmup_steps).
    # Adam moves every weight by about the learning rate in its first steps whatever the gradient's size, so
    # without one a run's first updates are its largest (docs/scenes.md, "The learning ladder").
    train.lr_warmup_steps = 0
    # Micro-batches whose gradients are accumulated into one optimizer step.
    train.gradient_accumulation_steps = 1
    # Gradient clipping (global norm) before each optimizer step.
    train.max_grad_norm = 1.0
    # Passes over the epoch's samples (PPO epochs); samples reshuffled each pass.
    train.num_inner_epochs = 1
    # Where log pi_old (the PPO ratio's denominator) comes from: "recompute" takes it in the training
    # layout with the sampling weights, before the epoch's first optimizer step, so the on-policy ratio
    # is exactly 1 (costs one extra forward of the trained steps of the micro-batches after the first
    # optimizer step; none when there is one optimizer step per epoch); "sampled" uses the log-probs
    # stored at sampling (ddpo-pytorch), whose ratio differs from 1 by the rounding of another batch
    # layout: up to ~1e-4 in fp16 and ~4e-4 in bf16 on a GPU, the size of the clip range.
    train.old_log_probs = "recompute"
    # Rollout and training at once, one epoch off policy (docs/async_rollout.md): epoch k+1's samples are drawn in a
    # background thread, with a frozen copy of the weights at the start of epoch k's training, while epoch k trains;
    # pi_old of the ratio is that copy's (exact). One process, train.objective="stepwise", no critic.
    train.async_rollout = False
    # With train.async_rollout: 0 draws the rollout in a thread of the trainer's process; 1 in a process of its own
    # (spawned by the trainer; weights sent to it each epoch, samples back, over a gloo group of the two).
    train.async_rollout_processes = 0
    # Use classifier-free guidance in the training forward pass (as when sampling).
    train.cfg = True
    # Advantages are clipped to [-adv_clip_max, adv_clip_max] (ddpo-pytorch).
    train.adv_clip_max = 5.0
    # PPO clip range (ddpo-pytorch's name); used for clip_ratio_low/high when those are None.
    train.clip_range = 1e-4
    # Asymmetric clipping (DAPO "clip-higher"); None: clip_range.
    train.clip_ratio_low = ml_collections.FieldReference(None, field_type=float)
    train.clip_ratio_high = ml_collections.FieldReference(None, field_type=float)
    # Dual-clip constant c (> 1): for negative advantages the loss is capped at -A * c.
    train.clip_ratio_c = 3.0
    # Fraction of the timesteps trained per trajectory when timestep_selection == "fraction" (DDPO).
    train.timestep_fraction = 1.0
    # Which denoising steps the actor trains: "all", "fraction" (a random subset, DDPO), "endpoints" (the
    # segment endpoints of an estimator that defines them: Group-PPO; with "all", Group-PPO trains every
    # valid step with its segment advantage), "segment_sample" (one step drawn inside each Group-PPO
    # segment, weighted by the segment's length: an unbiased estimate of the all-steps loss with K calls)
    # "segment_start" (the first, noisiest step of each Group-PPO segment, with the segment's advantage)
    # or "early" (the first train.early_steps steps: the noisiest, as Flow-GRPO-Fast / MixGRPO train).
    # The critic of Group-PPO trains at the endpoints.
    train.timestep_selection = "all"
    # Steps trained with timestep_selection="early".
    train.early_steps = 2
    # Policy loss: "vanilla" (PPO, asymmetric + dual clip), "gspo", "geo_mean" (GMPO), "dppo" (Flow-DPPO: a trust
    # region on the exact per-step KL to pi_old's Gaussian step in place of the ratio clip), "grpo_guard"
    # (GRPO-Guard: the clip on a per-step normalised ratio, timestep gradient reweighting). dppo and grpo_guard
    # need train.old_log_probs="recompute" (ddpo_group/algos/losses.py; docs/concepts.md).
    train.policy_loss = "vanilla"
    # dppo: the trust region delta > 0 on KL(pi_theta step || pi_old step) = mean over the latent's dimensions of
    # (mu - mu_old)^2 / (2 s^2); a step outside it whose update pushes further out gets no gradient. 1e-5:
    # verl-omni's Flow-DPPO recipe (kl_mask_threshold, the same KL).
    train.dppo_kl_max = 1e-5
    # grpo_guard: the timestep gradient weight, "dt" (1 / the step's length in flow time, the paper's) or "none".
    train.guard_reweight = "dt"
    # Loss aggregation over (sample, step) tokens: "token-mean", "seq-mean-token-sum",
    # "seq-mean-token-mean", "seq-mean-token-sum-norm".
    train.loss_agg_mode = "token-mean"
    # Add beta * KL(pi_theta || pi_ref) to the loss (GRPO).
    train.use_kl_loss = False
    train.beta = 0.0
    # KL of one step: "gaussian" (exact KL of the two Gaussian steps, the default), "flow_grpo" (flow models:
    # Flow-GRPO's scale, ||mu - mu_ref||^2 / (2 g^2) with g the noise level before the sqrt|dt| factor, i.e. the
    # exact KL times |dt|; docs/flow.md), "k1", "abs", "k2", "k3".
    train.kl_type = "gaussian"
    # Never train the last N steps of a trajectory: they keep their log-probs but get mask 0, like a step
    # without density. The last step's std is the smallest and its log-ratio the most sensitive; Flow-GRPO
    # trains timestep_fraction 0.99 of its steps (never the last) and DanceGRPO drops it: the flow presets use 1.
    train.skip_last_steps = 0
    # Keep a reference policy (needed by use_kl_loss, logged as ref/kl otherwise).
    train.use_reference_model = False
    # Reference mixup: every reference_update_freq optimizer steps, ref <- alpha * theta + (1 - alpha) * ref.
    # alpha 1.0 is a hard sync; freq 0 never updates (the reference stays the initial policy).
    train.reference_model_mixup_alpha = 1.0
    train.reference_update_freq = 0
    # Measure steps/grad_share (each denoising step's share of the policy gradient's norm, ddpo_group/training/diagnostics.py)
    # every this many epochs (0: never). It costs one squared norm per trainable parameter per backward, no copy.
    train.grad_share_every = 1
    # (trajectory, step) pairs per critic call when computing values without gradients; 0: all at once.
    train.eval_micro_batch_size = 0

    # What the update optimises. "stepwise": the policy losses on reverse-process steps above (GRPO, DDPO,
    # Group-PPO: log-probs of the sampled steps). "nft" (DiffusionNFT), "awm" (advantage-weighted matching),
    # "dgpo" (DGPO's group preferences) and "dpo" (Diffusion-DPO's pairs, online or offline):
    # forward-process objectives trained on the clean samples with the family's matching loss, no log-probs;
    # sampling keeps no per-step latents and may be deterministic (sample.eta 0). Settings: config.forward;
    # docs/forward.md. The stepwise-only fields (timestep_selection, old_log_probs, kl_type, ...) do not apply.
    train.objective = "stepwise"

    ###### Forward-process objectives (train.objective "nft" / "awm" / "dgpo" / "dpo"; docs/forward.md) ######
    config.forward = forward = ml_collections.ConfigDict()
    # Timesteps of the sampling grid trained per sample per inner epoch, drawn without replacement with fresh
    # noise each (0: all of them). DiffusionNFT trains int(0.99 * num_steps) of them.
    forward.num_timesteps = 0
    # DiffusionNFT's guidance strength beta in (0, 1]: v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v.
    forward.nft_beta = 1.0
    # Weight of each squared error: "uniform" (the papers' equations, in the family's target space), "x0"
    # (the error of the implied x0: sigma^2 |dv|^2 for flow models), "adaptive" (DiffusionNFT's reference
    # code: the x0 error over its own detached mean absolute value).
    forward.weighting = "uniform"
    # The sampling ("old") model lags the policy: after every epoch old <- d old + (1 - d) theta with
    # d = min(old_decay_rate * optimizer steps so far, old_decay_max); 0 and 0: old = theta (on-policy).
    # DiffusionNFT's default schedule: rate 0.001, max 0.5. It is a copy of the trainable weights (LoRA: the
    # adapter weights only) and is checkpointed.
    forward.old_decay_rate = 0.001
    forward.old_decay_max = 0.5
    # The preference objectives (train.objective "dgpo" / "dpo") compare the policy's matching loss with a frozen
    # reference's (train.use_reference_model=True; docs/forward.md). DGPO's beta (> 0; its reference code's
    # beta_dpo, 10-100 with a frozen reference): sharpness of the group preference's sigmoid; the loss is divided by it.
    forward.dgpo_beta = 100.0
    # DGPO's reference code's PPO-style clip (0: off): a sample's matching loss stops carrying gradient once its ratio
    # exp(||v_old - v||^2 - ||v_theta - v||^2) to the sampling model passes 1 + clip (A > 0) or 1 - clip (A < 0).
    forward.dgpo_clip_range = 0.0
    # Diffusion-DPO's beta T (> 0; its released code's beta_dpo, 5000 for SD 1.5 / SDXL): L = -log sigmoid(-beta/2 *
    # ((||e_w - e_theta||^2 - ||e_w - e_ref||^2) - (the same for the loser))).
    forward.dpo_beta = 5000.0
    # Where DPO's pairs come from: "online" (the best and the worst sample of each group of the epoch's own samples;
    # a group whose samples all have one advantage gives none) or "offline" (forward.preference_file).
    forward.dpo_pairs = "online"
    # The offline pairs: a JSON-lines file, one pair a line, {"prompt": str, "chosen": image path, "rejected": image
    # path} (paths relative to the file); the images are resized to the sampling resolution and encoded by the VAE.
    forward.preference_file = ""

    ###### Algorithm ######
    config.algorithm = algorithm = ml_collections.ConfigDict()
    # Advantage estimator: "ddpo" (PerPromptStatTracker with history), "grpo" (group statistics of
    # the batch), "rloo" (leave-one-out), "gae" (critic), "group_ppo" (critic + timestep grouping), "step_gain"
    # (each step's gain in the reward of the decoded one-step prediction x0_hat, normalised per prompt and step;
    # docs/critic.md).
    algorithm.adv_estimator = "grpo"
    # Divide GRPO advantages by the group std (False: Dr.GRPO).
    algorithm.norm_adv_by_std = True
    # GAE discount and lambda over denoising steps (gae, group_ppo).
    algorithm.gamma = 1.0
    algorithm.lam = 0.95

    ###### Per-prompt stat tracking (adv_estimator "ddpo") ######
    config.per_prompt_stat_tracking = tracking = ml_collections.ConfigDict()
    # Rewards kept per prompt (0: unbounded).
    tracking.buffer_size = 16
    # Below this many rewards for a prompt, the whole batch's mean / std are used.
    tracking.min_count = 16

    ###### Critic (gae, group_ppo) ######
    config.critic = critic = ml_collections.ConfigDict()
    critic.learning_rate = 1e-3
    critic.hidden = 64
    # Value clipping range of the clipped value loss.
    critic.cliprange_value = 0.5
    # Critic passes per epoch over the samples.
    critic.num_epochs = 1
    critic.max_grad_norm = 1.0
    # Steps whose returns the critic regresses on: "endpoints" (Group-PPO's segment endpoints, as Algorithm 2 is
    # written; every valid step for gae) or "all" (every valid step, also for group_ppo: more data, same cost class).
    critic.train_steps = "endpoints"
    # Value-only epochs at the start: for this many epochs the critic trains and the actor does not (a warm-up, so
    # that the first actor updates see a critic that has seen data). They sample and count as epochs.
    critic.warmup_epochs = 0
    # Critic designs (ddpo_group/training/critic_designs.py, docs/critic.md). What V(x_t) is: "network" (the ValueNetwork
    # above), "anchor" (the reward of the decoded one-step prediction x0_hat(x_t), Tweedie for DDIM: no learning;
    # one model call, one decode and one reward call per step with a density) or "anchor_residual" (the anchor plus
    # the ValueNetwork trained on returns - anchor). DDIM families (SD 1.x/2.x, the tiny models) only.
    critic.kind = "network"
    # GAE lambda of the critic's regression targets; negative: algorithm.lam. 1.0 (with gamma 1: every step's target
    # is the trajectory's reward) and warmup_epochs > 0 is VC-PPO / VAPO's value pre-training on Monte-Carlo returns
    # of the reference policy, with the actor's smaller algorithm.lam.
    critic.lam = -1.0

    ###### Group-PPO (docs/group_ppo.md) ######
    config.group_ppo = group_ppo = ml_collections.ConfigDict()
    group_ppo.variance_threshold = 1.0
    group_ppo.max_group_size = 16
    group_ppo.eps = 1e-6
    group_ppo.adaptive_threshold = True
    group_ppo.threshold_lr = 0.01
    group_ppo.min_threshold = 0.1
    group_ppo.max_threshold = 10.0
    group_ppo.target_compression = 0.75
    # Advantage normalisation after the segment means: "whiten" (GAE's whitening over the batch only, Algorithm 2
    # as written) or "group" (then, per prompt group and step, subtract the group mean and divide by its std: a
    # per-prompt baseline, as GRPO has).
    group_ppo.advantage_norm = "whiten"

    ###### Performance accounting (ddpo_group/training/perf.py, docs/performance.md) ######
    config.perf = perf = ml_collections.ConfigDict()
    # Log perf/<phase>_seconds, perf/<phase>_tflops, perf/sampling_mfu, perf/train_mfu and perf/overhead every epoch
    # (forward hooks on the denoiser and the VAE decoder; each input shape's FLOPs counted once). Costs well under
    # 1 % of an epoch on the CPU (measured on tiny: docs/performance.md); False: no hooks.
    perf.enabled = True
    # The device's peak in TFLOPS the MFU is measured against; 0: a GPU's published dense peak for the run's dtype,
    # or the CPU's measured float32 matmul throughput at the run's thread count (measured once, cached per user).
    perf.peak_tflops = 0.0

    ###### Prompts ######
    # Prompt source: a built-in set ("simple_animals", "imagenet_animals", "shapes") or a .txt/.json/.jsonl file.
    config.prompt_fn = "simple_animals"
    config.prompt_fn_kwargs = ml_collections.ConfigDict()

    ###### Rewards ######
    # A registered reward name, "package.module:function", "path/to/file.py:function" or "http://host:port".
    config.reward_fn = "jpeg_compressibility"
    # Several rewards with weights, e.g. {"aesthetic": 1.0, "jpeg_compressibility": 0.1}; empty: reward_fn alone.
    config.reward_weights = ml_collections.ConfigDict(allow_dotted_keys=True)  # keys may be URLs, file.py:fn specs
    # "sum_then_normalize" (weighted sum, then advantages; Flow-GRPO) or
    # "normalize_then_sum" (advantages per reward, then weighted sum; MixGRPO).
    config.reward_aggregation = "sum_then_normalize"
    # Threads computing rewards while sampling continues.
    config.reward_workers = 1
    # Seconds a batch's reward may take once sampling has finished; past it the run stops with an error naming
    # the reward (0: no limit). Generous for reward servers and large models.
    config.reward_timeout = 600.0
    # Videos: an image reward scores this many evenly spaced frames of each video (first and last among them) and
    # the video's reward is their mean (Flow-Factory's and verl-omni's per-frame rewards); 0: every frame. A video
    # reward (registered with video=True) gets the whole clip.
    config.reward_frames = 4
    # Keyword arguments of each reward, by reward name, e.g. {"aesthetic": {"weights_path": "/path/mlp.safetensors"}}.
    # On the command line: the whole dict (--config.reward_kwargs='{"ocr": {"allow_unquoted": true}}') or one keyword,
    # --config.reward_kwargs.ocr.allow_unquoted=True (the CLI creates the reward's entry: ddpo_group/cli/train.py).
    config.reward_kwargs = ml_collections.ConfigDict(allow_dotted_keys=True)

    return config
