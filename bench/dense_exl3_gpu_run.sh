#!/usr/bin/env bash
# On the device machine: install the exllamav3 wheels found in DIR/whl (VERSIONS to choose), build each JIT
# extension in the background (setsid: a build outlives the call while the machine is held), wait for it, then
# for each built version, in this order:
#   1. hazard, empty tune cache: a fresh process captures a never-run 6-bit wo_a at 1 and 16 rows, with
#      EXLLAMAV3_TUNE_CACHE naming a file that does not exist (nothing tuned on disk);
#   2. the check (dense_exl3_gpu_check.py run), its autotuner writing to the tune cache check.bin;
#   3. hazard again, a new empty tune cache (the same machine, after the check: is the machine's state enough?);
#   4. hazard with check.bin (a fresh process whose disk cache holds what the check tuned).
# Each step leaves a marker: run it again in the next call (within the warm window) to go on where it stopped.
#     bash DIR/dense_exl3_gpu_run.sh DIR
set -u
DIR=${1:?usage: dense_exl3_gpu_run.sh DIR}
LIMIT=${LIMIT_S:-570}
OUT=${OUT:-/tmp/dense-exl3-out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
VERSIONS=${VERSIONS:-$(ls "$DIR"/whl/exllamav3-*.whl | sed 's/.*exllamav3-\([^-]*\)-.*/\1/')}
JOBS=${MAX_JOBS:-$(( $(nproc) / $(echo $VERSIONS | wc -w) ))}
deps=$(ls "$DIR"/whl/*.whl | grep -v /exllamav3-)
[ -e /tmp/exl3-env ] || { nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; nvcc --version | tail -1; touch /tmp/exl3-env; }
for v in $VERSIONS; do
  w=/tmp/exl3-$v
  if [ ! -e $w/installed ]; then
    mkdir -p $w/tc
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $w/site "$DIR"/whl/exllamav3-$v-*.whl $deps && touch $w/installed || exit 1
  fi
  if [ ! -e $w/build.started ]; then
    date +%s > $w/build.started
    TORCH_EXTENSIONS_DIR=$w/ext MAX_JOBS=$JOBS PYTHONPATH=$w/site setsid bash -c \
      "python3 -c 'import exllamav3.ext' > $w/build.log 2>&1; echo \$? > $w/build.rc; date +%s > $w/build.done" \
      < /dev/null > /dev/null 2>&1 &
  fi
done
built() { [ "$(cat /tmp/exl3-$1/build.rc 2>/dev/null)" = 0 ]; }
while [ $SECONDS -lt $((LIMIT - 60)) ]; do
  pending=0; for v in $VERSIONS; do [ -e /tmp/exl3-$v/build.rc ] || pending=1; done
  [ $pending = 0 ] && break
  sleep 5
done
hazard() {  # version, label, tune cache (a file to copy, or none): a fresh process and cache file per row count
  local v=$1 label=$2 from=${3:-} w=/tmp/exl3-$1 rows left tc
  for rows in 1 16; do
    left=$((LIMIT - SECONDS))
    [ $left -gt 60 ] || return 1
    tc=$w/tc/$label-$rows.bin
    rm -f $tc; [ -z "$from" ] || cp $from $tc
    EXLLAMAV3_TUNE_CACHE=$tc timeout $((left - 10)) python3 -X faulthandler "$DIR"/dense_exl3_gpu_check.py hazard \
      "$DIR/prep" $rows > "$w/hazard-$label-$rows.log" 2>&1
    echo "$label, rows $rows: exit $?; tune cache $(stat -c %s $tc 2>/dev/null || echo none) bytes after" |
      tee -a "$OUT/hazard-$v.log"
    grep -E 'HAZARD|GPU assert|Fatal Python error|Segmentation|line [0-9]+ in ' "$w/hazard-$label-$rows.log" | head -8 |
      tee -a "$OUT/hazard-$v.log"
  done
}
for v in $VERSIONS; do
  w=/tmp/exl3-$v
  if [ ! -e $w/build.rc ]; then echo "exllamav3 $v: still building ($(ls $w/ext/exllamav3_ext/*.o 2>/dev/null | wc -l) objects)"; continue; fi
  echo "exllamav3 $v: build rc $(cat $w/build.rc) in $(( $(cat $w/build.done) - $(cat $w/build.started) )) s with $JOBS jobs" | tee -a "$OUT/build-$v.log"
  built $v || { tail -30 $w/build.log; continue; }
  export TORCH_EXTENSIONS_DIR=$w/ext PYTHONPATH=$w/site
  [ -e $w/step1 ] || { hazard $v empty-cache && touch $w/step1; } || continue
  if [ ! -e $w/step2 ]; then
    left=$((LIMIT - SECONDS))
    [ $left -gt 90 ] || { echo "exllamav3 $v: no time left for the check"; continue; }
    set -o pipefail
    start=$SECONDS
    EXLLAMAV3_TUNE_CACHE=$w/tc/check.bin timeout $((left - 30)) python3 "$DIR"/dense_exl3_gpu_check.py run "$DIR/prep" 2>&1 |
      tee "$OUT/run-$v.log" && touch $w/step2
    set +o pipefail
    echo "check: $((SECONDS - start)) s; tune cache check.bin: $(stat -c %s $w/tc/check.bin 2>/dev/null) bytes" | tee -a "$OUT/run-$v.log"
    [ -e $w/step2 ] || continue
  fi
  [ -e $w/step3 ] || { hazard $v empty-cache-after-check && touch $w/step3; } || continue
  [ -e $w/step4 ] || { hazard $v check-cache $w/tc/check.bin && touch $w/step4; } || continue
done
