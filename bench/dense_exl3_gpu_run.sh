#!/usr/bin/env bash
# On the device machine: install exllamav3 1.6.5 and 1.4.5 side by side (wheels in DIR/whl, made here as
# bench/dense_exl3_gpu_check.py says), build both JIT extensions in the background (setsid: the builds outlive the
# call while the machine is held), wait for them, then run the check and the capture hazard for each built version.
# Idempotent: run it again in the next call (within the warm window) to continue where the last one stopped.
#     bash DIR/dense_exl3_gpu_run.sh DIR
set -u
DIR=${1:?usage: dense_exl3_gpu_run.sh DIR}
LIMIT=${LIMIT_S:-570}
OUT=${OUT:-/tmp/dense-exl3-out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
declare -A JOBS=([1.6.5]=10 [1.4.5]=6)  # 177 and 109 .cu files on 16 cores
deps=$(ls "$DIR"/whl/*.whl | grep -v /exllamav3-)
[ -e /tmp/exl3-env ] || { nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; nvcc --version | tail -1; touch /tmp/exl3-env; }
for v in 1.6.5 1.4.5; do
  w=/tmp/exl3-$v
  if [ ! -e $w/installed ]; then
    mkdir -p $w
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $w/site "$DIR"/whl/exllamav3-$v-*.whl $deps && touch $w/installed || exit 1
  fi
  if [ ! -e $w/build.started ]; then
    date +%s > $w/build.started
    TORCH_EXTENSIONS_DIR=$w/ext MAX_JOBS=${JOBS[$v]} PYTHONPATH=$w/site setsid bash -c \
      "python3 -c 'import exllamav3.ext' > $w/build.log 2>&1; echo \$? > $w/build.rc; date +%s > $w/build.done" \
      < /dev/null > /dev/null 2>&1 &
  fi
done
while [ $SECONDS -lt $((LIMIT - 60)) ]; do
  [ -e /tmp/exl3-1.6.5/build.rc ] && [ -e /tmp/exl3-1.4.5/build.rc ] && break
  [ -e /tmp/exl3-1.6.5/build.rc ] && [ ! -e /tmp/exl3-1.6.5/checked ] && break
  sleep 5
done
for v in 1.6.5 1.4.5; do
  w=/tmp/exl3-$v
  if [ ! -e $w/build.rc ]; then echo "exllamav3 $v: still building ($(ls $w/ext/exllamav3_ext/*.o 2>/dev/null | wc -l) objects)"; continue; fi
  echo "exllamav3 $v: build rc $(cat $w/build.rc) in $(( $(cat $w/build.done) - $(cat $w/build.started) )) s"
  [ "$(cat $w/build.rc)" = 0 ] || { tail -30 $w/build.log; continue; }
  [ -e $w/checked ] && continue
  left=$((LIMIT - SECONDS))
  [ $left -gt 60 ] || { echo "exllamav3 $v: no time left for the check"; continue; }
  export TORCH_EXTENSIONS_DIR=$w/ext MAX_JOBS=${JOBS[$v]} PYTHONPATH=$w/site
  set -o pipefail
  timeout $((left - 40)) python3 "$DIR"/dense_exl3_gpu_check.py run "$DIR/prep" 2>&1 | tee "$OUT/run-$v.log" && touch $w/checked
done
for v in 1.6.5 1.4.5; do  # the capture hazard: one fresh process per row count
  w=/tmp/exl3-$v
  [ "$(cat $w/build.rc 2>/dev/null)" = 0 ] && [ ! -e $w/hazard ] || continue
  export TORCH_EXTENSIONS_DIR=$w/ext MAX_JOBS=${JOBS[$v]} PYTHONPATH=$w/site
  for rows in 1 16; do
    left=$((LIMIT - SECONDS))
    [ $left -gt 40 ] || break
    # The probe may kill the process (a segfault, a GPU assert): keep its exit status and its last lines.
    timeout $((left - 10)) python3 -X faulthandler "$DIR"/dense_exl3_gpu_check.py hazard "$DIR/prep" $rows \
      > "$w/hazard-$rows.log" 2>&1
    echo "rows $rows: exit $?" | tee -a "$OUT/hazard-$v.log"
    grep -E 'HAZARD|GPU assert|Fatal Python error|line [0-9]+ in ' "$w/hazard-$rows.log" | head -8 | tee -a "$OUT/hazard-$v.log"
  done
  touch $w/hazard
done
