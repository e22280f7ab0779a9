#!/usr/bin/env bash
# The critic study of issue 35 (docs/critic.md): does a critic's per-step credit beat the best critic-free method at
# equal compute? The main job's task (config/grpo.py:tiny, 18 big-square prompts, 10 DDIM steps, fixed-noise
# evaluation of 18 x 8 images), 40 epochs, evaluation every 5. Every (method, seed) is a single-thread process of
# its own, 3-5 minutes on one core; JOBS run at once (2 on a 2-core machine: about 3 hours in all; 14 beside the GPU
# checks on a lent 16-core machine: 19 runs of the sweep in about 8 minutes, benchmarks/device_session.sh lease).
#
#   bash benchmarks/critic_study.sh [OUT] [JOBS]       # default OUT=benchmarks/results/critic_runs, JOBS=2
#
# STAGES (default "decomposition sweep seeds merged") runs some of the stages; SWEEP_LRS (default "5e-5 1e-4") the
# sweep's learning rates, so that the sweep can be split over machines (each half's OUT/sweep/parts/*/bench_seeds.json
# merge with `bench_training.py --merge`): e.g. STAGES=sweep SWEEP_LRS=1e-4 on a lent 16-core machine, SWEEP_LRS=5e-5
# here. The sweep's one run of today's default comes with the first of SWEEP_LRS that is 5e-5.
#
# The plan:
#   0. decomposition  benchmarks/variance_decomposition.py (no training, minutes): each step's share of the
#                     reward's within-prompt variance and how much a trained ValueNetwork / the anchor explain;
#                     OUT/decomposition*.json
#   1. sweep (seed 42, one run each)
#        critic-free  today's default (group_ppo); GRPO + KL with noise and training in a 2- and a 4-step window
#                     (sde_window2 with sample.sde_window_size 2 / 4) at lr 5e-5 and 1e-4
#        with critic  critic_window (per-step critic advantages in a 4-step window, every window step trained)
#                     and critic_everywhere (noise at all 10 steps, the first 4 trained) for each design,
#                     critic.kind = network | anchor | anchor_residual, actor lambda (algorithm.lam) 0.5 / 0.95,
#                     lr 5e-5 / 1e-4; value pre-training (critic.warmup_epochs 3, critic.lam 1: Monte-Carlo returns
#                     of the reference policy) for network and anchor_residual; a 3-step window (K = all 3)
#   2. seeds (42-44)  GRPO + KL (the main job), today's default, the best critic-free arm (BEST_FREE), the group
#                     sharing its initial noise (group_shared: TempFlow-GRPO's seed groups), TempFlow-style
#                     branching at a step drawn each epoch (branch), and the best of each critic arm (BEST_WINDOW,
#                     BEST_EVERYWHERE); the defaults are the sweep's best of 2026-11-26 (docs/critic.md section 4)
#   3. merged         the 3-seed table (bench_training.py --merge) and the same-budget comparison in model calls with
#                     issue 35's targets (benchmarks/critic_compute.py): OUT/merged/critic_compute.md / .json
#
# Compute: benchmarks/critic_compute.py counts each epoch's model calls from the runs' metrics (sampling NFEs,
# training forward + backward passes, the reference's and the recompute pass's forwards) and reward calls
# (trajectories + critic/anchor_decodes, one VAE decode and one reward call each); the ValueNetwork's calls (a small
# conv net) are in the seconds (time/critic). Seconds are training seconds with JOBS runs sharing the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/critic_runs}
JOBS=${2:-2}
STAGES=${STAGES:-decomposition sweep seeds merged}
SWEEP_LRS=${SWEEP_LRS:-5e-5 1e-4}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
PY=${PYTHON:-.venv/bin/python}
bench() {  # bench STAGE SEEDS METHODS
  "$PY" benchmarks/bench_training.py --common-variant tiny --seeds "$2" --seed-start 42 --epochs 40 --eval-freq 5 \
    --jobs "$JOBS" --run-timeout 3600 --methods "$3" --output-dir "$OUT/$1"
}

# --- 0. where the variance is (no training) ---
mkdir -p "$OUT"
if stage decomposition; then
OMP_NUM_THREADS=1 "$PY" benchmarks/variance_decomposition.py --critic-epochs 30 --output "$OUT/decomposition.json" \
  --png "$OUT/decomposition.png"
OMP_NUM_THREADS=1 "$PY" benchmarks/variance_decomposition.py --others deterministic \
  --output "$OUT/decomposition_deterministic.json" --png "$OUT/decomposition_deterministic.png"
fi

# --- 1. one seed: the sweep ---
M=""
[[ " $SWEEP_LRS " == *" 5e-5 "* ]] && M="default=group_ppo:train.learning_rate=5e-5"
for lr in $SWEEP_LRS; do
  M="${M:+$M,}grpo_w2_lr$lr=sde_window2:train.learning_rate=$lr"
  M="$M,grpo_w4_lr$lr=sde_window2:sample.sde_window_size=4:train.learning_rate=$lr"
  for kind in network anchor anchor_residual; do
    for lam in 0.5 0.95; do
      M="$M,win_${kind}_lam${lam}_lr$lr=critic_window:critic.kind=$kind:algorithm.lam=$lam:train.learning_rate=$lr"
      M="$M,all_${kind}_lam${lam}_lr$lr=critic_everywhere:critic.kind=$kind:algorithm.lam=$lam:train.learning_rate=$lr"
    done
  done
  for kind in network anchor_residual; do
    PRE="critic.kind=$kind:critic.warmup_epochs=3:critic.lam=1.0:critic.num_epochs=4:algorithm.lam=0.5"
    M="$M,win_${kind}_pre_lr$lr=critic_window:$PRE:train.learning_rate=$lr"
    M="$M,all_${kind}_pre_lr$lr=critic_everywhere:$PRE:train.learning_rate=$lr"
  done
  M="$M,win3_anchor_residual_lr$lr=critic_window:sample.sde_window_size=3:critic.kind=anchor_residual:algorithm.lam=0.5:train.learning_rate=$lr"
done
stage sweep && bench sweep 1 "$M"

# --- 2. three seeds of the best of each arm ---
BEST_FREE=${BEST_FREE:-free=sde_window2:sample.sde_window_size=4:train.learning_rate=5e-5}
BEST_WINDOW=${BEST_WINDOW:-window=critic_window:critic.kind=network:algorithm.lam=0.95:train.learning_rate=5e-5}
BEST_EVERYWHERE=${BEST_EVERYWHERE:-everywhere=critic_everywhere:critic.kind=network:algorithm.lam=0.95:train.learning_rate=5e-5}
ARMS="grpo_kl,default=group_ppo:train.learning_rate=5e-5,$BEST_FREE"
ARMS="$ARMS,shared=group_shared:train.learning_rate=5e-5,branch=branch:train.learning_rate=5e-5,$BEST_WINDOW,$BEST_EVERYWHERE"
stage seeds && bench seeds 3 "$ARMS"

# --- 3. merged: the table, and the same-budget comparison relative to the best critic-free arm ---
if stage merged; then
  "$PY" benchmarks/bench_training.py --merge "$OUT/seeds/bench_seeds.json" --reference grpo_kl --output-dir "$OUT/merged"
  "$PY" benchmarks/critic_compute.py "$OUT/seeds/bench_seeds.json" --free "${BEST_FREE%%=*}" --grpo grpo_kl \
    --critic "${BEST_WINDOW%%=*},${BEST_EVERYWHERE%%=*}" --output "$OUT/merged/critic_compute.json"
fi
