#!/usr/bin/env bash
# The Group-PPO study of docs/group_ppo.md, on the main job's task (config/grpo.py:tiny), 40 epochs,
# fixed-noise evaluation every 5 epochs. Every (method, seed) is a single-thread process of its own;
# JOBS of them run at once (2 on a 2-core machine: about 2 hours in all; 16 on a 16-core machine).
#
#   bash benchmarks/group_ppo_study.sh [OUT] [JOBS]        # default OUT=benchmarks/results/group_ppo_runs, JOBS=2
#
# Stages (each writes OUT/<stage>/bench_seeds.json and .md):
#   sweep      one seed (42): learning rates 5e-5 / 1e-4 / 2e-4 of Algorithm 2 and its variants, and of
#              the windows where noise is only at the trained steps
#   seeds      seeds 42-44: the default and its ablations, the references
#   forward_*  DiffusionNFT and AWM (docs/forward.md): a one-seed learning-rate sweep, 3 seeds of the best of each,
#              one-seed ablations
#   merged     all 3-seed stages in one table, relative to grpo_kl (the main job)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/group_ppo_runs}
JOBS=${2:-2}
PY=${PYTHON:-.venv/bin/python}
KL="train.use_reference_model=True:train.use_kl_loss=True:train.beta=0.01"
NOKL="train.use_kl_loss=False:train.use_reference_model=False"
bench() {  # bench STAGE SEEDS METHODS
  "$PY" benchmarks/bench_training.py --common-variant tiny --seeds "$2" --seed-start 42 --epochs 40 --eval-freq 5 \
    --jobs "$JOBS" --run-timeout 2400 --methods "$3" --output-dir "$OUT/$1"
}

# --- one seed: learning-rate sweeps (group_ppo_endpoints = Algorithm 2 as written) ---
M=""
for lr in 5e-5 1e-4 2e-4; do
  M="$M,w2_lr$lr=sde_window2:train.learning_rate=$lr"
  M="$M,alg2_lr$lr=group_ppo_endpoints:train.learning_rate=$lr"
  M="$M,start_lr$lr=group_ppo_start:train.learning_rate=$lr"
  M="$M,w4end_lr$lr=group_ppo_endpoints:sample.sde_window_size=4:train.learning_rate=$lr"
  M="$M,w4start_lr$lr=group_ppo_start:sample.sde_window_size=4:train.learning_rate=$lr"
  M="$M,w4startgn_lr$lr=group_ppo_start:sample.sde_window_size=4:group_ppo.advantage_norm=group:train.learning_rate=$lr"
  M="$M,w4startgncw_lr$lr=group_ppo_start:sample.sde_window_size=4:group_ppo.advantage_norm=group:critic.warmup_epochs=2:critic.train_steps=all:critic.num_epochs=4:train.learning_rate=$lr"
  M="$M,w2startgn_lr$lr=group_ppo_start:sample.sde_window_size=2:group_ppo.advantage_norm=group:train.learning_rate=$lr"
done
for lr in 5e-5 1e-4; do
  M="$M,w1_lr$lr=sde_window2:sample.sde_window_size=1:train.learning_rate=$lr"
  M="$M,gpw1_lr$lr=group_ppo_start:sample.sde_window_size=1:group_ppo.advantage_norm=group:train.learning_rate=$lr"
  M="$M,gpw1kl_lr$lr=group_ppo_start:sample.sde_window_size=1:group_ppo.advantage_norm=group:$KL:train.learning_rate=$lr"
  M="$M,gpw2kl_lr$lr=group_ppo_start:sample.sde_window_size=2:group_ppo.advantage_norm=group:$KL:train.learning_rate=$lr"
  M="$M,gpw2k2kl_lr$lr=group_ppo_start:sample.sde_window_size=2:group_ppo.max_group_size=1:group_ppo.advantage_norm=group:$KL:train.learning_rate=$lr"
  M="$M,gpcrit_lr$lr=group_ppo_start:group_ppo.max_group_size=3:group_ppo.advantage_norm=group:critic.train_steps=all:critic.num_epochs=4:critic.warmup_epochs=5:algorithm.lam=0.5:train.learning_rate=$lr"
done
M="$M,w1s3_lr5e-5=sde_window2:sample.sde_window_size=1:sample.sde_window_start=3:train.learning_rate=5e-5"
M="$M,gpw1s3kl_lr5e-5=group_ppo_start:sample.sde_window_size=1:sample.sde_window_start=3:group_ppo.advantage_norm=group:critic.train_steps=all:critic.num_epochs=4:$KL:train.learning_rate=5e-5"
M="$M,gpw1s3klcw_lr5e-5=group_ppo_start:sample.sde_window_size=1:sample.sde_window_start=3:group_ppo.advantage_norm=group:critic.train_steps=all:critic.num_epochs=4:critic.warmup_epochs=3:$KL:train.learning_rate=5e-5"
bench sweep 1 "${M#,}"

# --- three seeds ---
bench refs 3 "grpo_kl,ddpo"
M="group_ppo=group_ppo:train.learning_rate=5e-5"
M="$M,group_ppo_nokl=group_ppo:$NOKL:train.learning_rate=5e-5"
M="$M,group_ppo_whiten=group_ppo:group_ppo.advantage_norm=whiten:train.learning_rate=5e-5"
M="$M,grpo_window1=sde_window2:sample.sde_window_size=1:train.learning_rate=5e-5"
M="$M,grpo_window2=sde_window2:train.learning_rate=1e-4"
M="$M,alg2_start=group_ppo_start:train.learning_rate=5e-5"
M="$M,group_ppo_warmup=group_ppo:critic.warmup_epochs=3:critic.train_steps=all:train.learning_rate=5e-5"
M="$M,group_ppo_lr1e-4=group_ppo:train.learning_rate=1e-4"
M="$M,alg2_endpoints=group_ppo_endpoints:train.learning_rate=5e-5"
M="$M,group_ppo_step3=group_ppo:sample.sde_window_start=3:train.learning_rate=5e-5"
M="$M,grpo_window1_step3=sde_window2:sample.sde_window_size=1:sample.sde_window_start=3:train.learning_rate=5e-5"
bench seeds 3 "$M"

# --- the forward-process methods beside them (docs/forward.md) ---
# one seed: learning rates of DiffusionNFT (the paper's objective settings) and of AWM (the reference code's clip
# range 1, and the main job's 1e-2)
A="forward.weighting=adaptive"
M="nft_lr1e-4=nft:$A:train.learning_rate=1e-4,nft_lr2e-4=nft:$A:train.learning_rate=2e-4,nft_lr5e-4=nft:$A:train.learning_rate=5e-4"
for lr in 1e-5 3e-5 1e-4; do M="$M,awm_lr$lr=awm:train.clip_range=1.0:train.learning_rate=$lr"; done
M="$M,awm_clip_lr1e-4=awm:train.clip_range=0.01:train.learning_rate=1e-4"
bench forward_sweep 1 "$M"
# one-seed ablations of DiffusionNFT's weighting and beta; three seeds of the best of each (the uniform
# weighting, the tiny_nft default, was found by the ablation and then run on seeds 43-44)
bench forward_ablations 1 "nft_uniform_lr2e-4=nft:forward.weighting=uniform:train.learning_rate=2e-4,nft_beta0.1_lr2e-4=nft:$A:forward.nft_beta=0.1:train.learning_rate=2e-4"
bench forward_seeds 3 "nft_lr2e-4=nft:$A:train.learning_rate=2e-4,nft_uniform_lr2e-4=nft:forward.weighting=uniform:train.learning_rate=2e-4,awm_clip_lr1e-4=awm:train.clip_range=0.01:train.learning_rate=1e-4"

"$PY" benchmarks/bench_training.py --merge "$OUT/refs/bench_seeds.json" "$OUT/seeds/bench_seeds.json" \
  "$OUT/forward_seeds/bench_seeds.json" --reference grpo_kl --output-dir "$OUT/merged"
