#!/usr/bin/env bash
# Reproduce the paper's small-model experiments: train the four objectives and the AR model, then write the rows
# of Table main_results_metrics and the figures (Gen PPL / entropy / validation PPL over training, Gen PPL vs
# sampling steps, step time and memory), plus an ε sweep of SDDLM-V1/V2 (the paper does not give its ε).
#
#   bash reproduce.sh tiny            # CPU, built-in corpus: a smoke test of the pipeline, NOT of the paper's claims
#   bash reproduce.sh owt             # the paper's OWT setting: DiT-small, 1M steps x 512 x 1024 (NPROC=8 GPUs)
#   bash reproduce.sh lm1b            # the paper's LM1B setting: DiT-small, 1M steps x 512 x 128, bert-base-uncased
#   bash reproduce.sh tiny eval report   # only some stages: judge train eps eval bench report (default: all)
#   bash reproduce.sh tiny psi        # the Psi samplers' steps-quality table (not in the default stages)
#
# Every stage skips finished work, so a rerun (after an interruption, or to add stages) redoes nothing:
# a run is finished when OUT_DIR/DONE exists (an interrupted one continues with --resume 1), an evaluation when
# its JSON exists. Delete a file to redo that piece.
# Environment: RUNS (default out-reproduce/SCALE), NPROC (processes per run: torchrun when > 1; default: the GPU
# count, 1 on CPU), PAR (runs trained at the same time; default 1), JUDGE (Gen PPL judge; tiny: the AR run,
# owt/lm1b: gpt2-large as in the paper, which needs transformers and the network; or an AR ckpt.pt, offline).
# TRAIN_EXTRA (flags added to every training run, e.g. "--max_iters 30" for a quick check of the script),
# ITERS (tiny: steps of the objectives and ε runs, default the tiny preset's 900; curves every ITERS / 4),
# SAMPLES (Gen PPL samples per evaluation), FINAL_STEP (the sampler's final step, default ancestral for every
# objective, as the paper's comparison; auto gives each objective its measured better one), EPS_LOSSES and EPS_VALUES (the ε sweep; default V1 and V2 at
# 1e-3 and 1e-8: at paper scale each is a full run). The psi stage: PSI_LOSSES (default sddlm_v1 duo), PSI_STEPS
# (default 16,64,256,1024) and PSI_SETTINGS, sampler flag sets separated by ";" (eval_ppl.py's --sampler and
# --psi_* flags; default a constant kappa = 0.9 and a ReMDM max-capped loop), each beside the ancestral sampler.
# owt/lm1b need the data (datasets + network the first time, then
# data/ holds the token memmaps).
set -euo pipefail
cd "$(dirname "$0")"
SCALE=${1:?usage: bash reproduce.sh tiny|owt|lm1b [judge train eps eval bench report psi]}
shift
STAGES=${*:-judge train eps eval bench report}
RUNS=${RUNS:-out-reproduce/$SCALE}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 1 ))}
PAR=${PAR:-1}
FINAL_STEP=${FINAL_STEP:-ancestral}   # the same final step for every objective (auto: each its measured better one)
OBJECTIVES="sddlm sddlm_v1 sddlm_v2 duo"
EPS_LOSSES=${EPS_LOSSES:-sddlm_v1 sddlm_v2}
EPS_VALUES=${EPS_VALUES:-1e-3 1e-8}     # besides the default losses.EPS = 1e-6 of the main runs
PSI_LOSSES=${PSI_LOSSES:-sddlm_v1 duo}
PSI_STEPS=${PSI_STEPS:-16,64,256,1024}
PSI_SETTINGS=${PSI_SETTINGS:---sampler ancestral;--sampler psi --psi_kappa eta --psi_eta 0.9;--sampler psi --psi_profile loop --psi_kappa eta,max_capped,eta --psi_eta 1,0.02,1 --psi_loop_t 0.1}
case $SCALE in
  tiny)   # train.py's tiny preset (96 wide, 1.02M params, 900 steps x 32 x 128 tokens, the curriculum for the
          # first half of any --max_iters, SentencePiece 2048)
    TRAIN="--preset tiny --data_dir $RUNS/data --num_samples 0"
    ITERS=${ITERS:-900}                 # steps of the objectives and ε runs (the AR judge: the preset's 900)
    OBJ="--max_iters $ITERS"
    CURVES="--gen_interval $(( ITERS / 4 )) --gen_num_samples 32 --gen_steps 128 --keep_every $(( ITERS / 4 ))"
    AR_FLAGS=""
    JUDGE=${JUDGE:-$RUNS/ar/ckpt.pt}
    STEPS=8,16,32,64,128; TABLE_STEPS=128; SAMPLES=${SAMPLES:-64}; EVAL_BATCH=32
    BENCH="--preset tiny --threads 1";;
  owt|lm1b)   # the presets carry the Appendix table, Duo's data and curriculum, curves every 5000 steps
    TRAIN="--preset $SCALE"
    OBJ=""
    CURVES=""
    AR_FLAGS="--curriculum_iters 0 --gen_interval 0"     # the AR baseline: no curriculum; an offline judge
    JUDGE=${JUDGE:-gpt2-large}
    STEPS=16,32,64,128,256,512,1024; TABLE_STEPS=1024; EVAL_BATCH=64
    SAMPLES=${SAMPLES:-$([ "$SCALE" = owt ] && echo 800 || echo 960)}   # Duo's scripts: 8 x 100 (OWT), 64 x 15 (LM1B)
    L=$([ "$SCALE" = owt ] && echo 1024 || echo 128)
    BENCH="--preset $SCALE --block_size $L --batch_size $([ "$SCALE" = owt ] && echo 32 || echo 64) --device cuda --compile 1";;
  *) echo "error: unknown scale '$SCALE' (tiny, owt or lm1b)" >&2; exit 2;;
esac
# what the chosen stages need beyond README's install, said now in one line rather than after hours of training
needs() {   # needs MODULE WHAT: exit 2 naming the package when MODULE cannot be imported
  python -c "import $1" 2>/dev/null || { echo "error: $2 needs $1, an optional extra: pip install $1" >&2; exit 2; }
}
case " $STAGES " in *" report "*) needs matplotlib "the report stage (figures/plot.py draws the figures)";; esac
if [[ ! -e $JUDGE && $JUDGE != */* ]] && [[ " $STAGES " =~ \ (train|eval|psi)\  ]]; then
  needs transformers "the Gen PPL judge $JUDGE (JUDGE=path/to/ar/ckpt.pt judges offline)"
fi
mkdir -p "$RUNS/logs" "$RUNS/evals"
if (( NPROC > 1 )); then LAUNCH="torchrun --standalone --nproc_per_node=$NPROC train.py"; else LAUNCH="python train.py"; fi

last_line() {   # the last line of a log (a failed script's one `error:` line), without progress-bar redraws
  tr '\r' '\n' < "$1" | grep -v '^[[:space:]]*$' | tail -n 1
}

train() {   # train NAME FLAGS...: skip a finished run, continue an interrupted one; output in RUNS/logs/NAME.log
  local name=$1 out=$RUNS/$1
  shift
  if [ -e "$out/DONE" ]; then echo "skip   $out (finished)"; return 0; fi
  local resume=""
  [ -e "$out/ckpt.pt" ] && resume="--resume 1"
  echo "train  $out  (log: $RUNS/logs/$name.log)"
  mkdir -p "$(dirname "$RUNS/logs/$name.log")"
  $LAUNCH $TRAIN "$@" ${TRAIN_EXTRA:-} --out_dir "$out" $resume > "$RUNS/logs/$name.log" 2>&1 \
    || { local code=$?; echo "error: training $name failed ($(last_line "$RUNS/logs/$name.log")); see" \
           "$RUNS/logs/$name.log" >&2; return $code; }
  touch "$out/DONE"
}

train_all() {   # train_all "NAME FLAGS..." ...: at most PAR at a time; any failure stops the script
  local pids=() job
  for job in "$@"; do
    train $job &
    pids+=($!)
    if (( ${#pids[@]} >= PAR )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done
  for job in "${pids[@]}"; do wait "$job"; done
}

evaluate() {   # evaluate OUT.json RUN ARGS...: eval_ppl.py on RUN/ckpt.pt unless OUT.json exists; RUN must be finished
  local out=$1 run=$2
  shift 2
  if [ -e "$out" ]; then echo "skip   $out"; return 0; fi
  [ -e "$run/DONE" ] || { echo "error: $run is not finished (no $run/DONE): run its training stage first" >&2; return 1; }
  echo "eval   $out"
  python eval_ppl.py --ckpt "$run/ckpt.pt" "$@" --out "$out" > "$out.log" 2>&1 \
    || { local code=$?; echo "error: evaluating $run failed ($(last_line "$out.log")); see $out.log" >&2; return $code; }
}

for stage in $STAGES; do
  case $stage in
    judge)   # the AR model: Table row and, at tiny scale, the offline Gen PPL judge
      train_all "ar --loss ar $AR_FLAGS";;
    train)   # the four objectives with Gen PPL / entropy curves during training and kept checkpoints
      jobs=()
      for loss in $OBJECTIVES; do jobs+=("$loss --loss $loss $OBJ $CURVES --judge $JUDGE"); done
      train_all "${jobs[@]}";;
    eps)     # the ε sweep: V1 and V2 at other ε (the default ε is the main run)
      jobs=()
      for loss in $EPS_LOSSES; do for eps in $EPS_VALUES; do
        jobs+=("eps/$loss-eps$eps --loss $loss --eps $eps $OBJ --gen_interval 0")
      done; done
      train_all "${jobs[@]}";;
    eval)    # Gen PPL vs sampling steps (Fig. steps, Table main_results_metrics) and NELBO PPL of every model
      for loss in $OBJECTIVES; do
        evaluate "$RUNS/evals/$loss-genppl.json" "$RUNS/$loss" --metric genppl --judge "$JUDGE" \
          --steps "$STEPS" --num_samples "$SAMPLES" --batch_size "$EVAL_BATCH" --seed 0 --final_step "$FINAL_STEP"
        evaluate "$RUNS/evals/$loss-nelbo.json" "$RUNS/$loss" --metric nelbo
      done
      evaluate "$RUNS/evals/ar-nelbo.json" "$RUNS/ar" --metric nelbo
      for loss in $EPS_LOSSES; do for eps in $EPS_VALUES; do
        evaluate "$RUNS/evals/$loss-eps$eps-genppl.json" "$RUNS/eps/$loss-eps$eps" --metric genppl \
          --judge "$JUDGE" --steps "$TABLE_STEPS" --num_samples "$SAMPLES" --batch_size "$EVAL_BATCH" --seed 0 \
          --final_step "$FINAL_STEP"
        evaluate "$RUNS/evals/$loss-eps$eps-nelbo.json" "$RUNS/eps/$loss-eps$eps" --metric nelbo
      done; done;;
    psi)     # Gen PPL vs sampling steps of the ancestral and Psi samplers (evals-psi/, not read by the report)
      mkdir -p "$RUNS/evals-psi"
      IFS=';' read -ra settings <<< "$PSI_SETTINGS"
      for loss in $PSI_LOSSES; do for i in "${!settings[@]}"; do
        evaluate "$RUNS/evals-psi/$loss-sampler$i-genppl.json" "$RUNS/$loss" --metric genppl --judge "$JUDGE" \
          --steps "$PSI_STEPS" --num_samples "$SAMPLES" --batch_size "$EVAL_BATCH" --seed 0 \
          --final_step "$FINAL_STEP" ${settings[$i]}
      done; done;;
    bench)   # step time and memory per objective (Fig. time)
      if [ -e "$RUNS/bench.json" ]; then echo "skip   $RUNS/bench.json"; else
        echo "bench  $RUNS/bench.json"
        python bench/bench.py --json 1 $BENCH > "$RUNS/bench.json.tmp" 2> "$RUNS/logs/bench.log" \
          || { code=$?; echo "error: the benchmark failed ($(last_line "$RUNS/logs/bench.log")); see" \
                 "$RUNS/logs/bench.log" >&2; exit $code; }
        mv "$RUNS/bench.json.tmp" "$RUNS/bench.json"
      fi;;
    report)  # the figures and the table (always redrawn: cheap)
      runs=$(for loss in $OBJECTIVES ar; do printf '%s,' "$RUNS/$loss"; done)
      evals=$(ls "$RUNS"/evals/*.json | paste -sd, -)
      bench=$([ -e "$RUNS/bench.json" ] && echo "$RUNS/bench.json" || true)
      python figures/plot.py --runs "$runs" --evals "$evals" ${bench:+--bench "$bench"} --out_dir "$RUNS/figures" \
        --table "$RUNS/table.md" --table_steps "$TABLE_STEPS" --overwrite 1;;
    *) echo "error: unknown stage '$stage' (judge train eps eval bench report psi)" >&2; exit 2;;
  esac
done
