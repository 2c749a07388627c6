#!/usr/bin/env bash
# A mod for eugr/spark-vllm-docker: patch vLLM's DeepSeek-V4 code with patch-dsv4, or stop the launch.
#
# launch-cluster.sh runs a mod's run.sh with no arguments, in every container, on every launch. This one:
#   1. installs patch-dsv4 from the wheels beside it (wheels/: no network; see README.md here),
#   2. runs `patch-dsv4 apply`, then `patch-dsv4 verify`, with the opt-ins PATCH_DSV4_WITH names
#      (e.g. PATCH_DSV4_WITH=aux-streams,dense-exl3: patch-dsv4 reads it itself),
#   3. prints the tree's fingerprint, and exits non-zero on any refusal, which stops the cluster.
# Pass PATCH_DSV4_WITH (and PATCH_DSV4_EXPECT, PATCH_DSV4_GUARD) to every container, workers included.
#
# Settings (environment; all optional):
#   PATCH_DSV4_PYTHON          the interpreter of vLLM's environment (default: python3)
#   PATCH_DSV4_SITE_PACKAGES   act on this directory holding vllm/ instead (e.g. a `pip install --target` dir)
#   PATCH_DSV4_WHEELS          where the wheels are (default: wheels/ beside this script)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PATCH_DSV4_PYTHON:-python3}"
wheels="${PATCH_DSV4_WHEELS:-$here/wheels}"

say() { printf 'patch-dsv4 mod: %s\n' "$*" >&2; }

if ! ls "$wheels"/patch_dsv4-*.whl >/dev/null 2>&1; then
    say "no patch_dsv4 wheel in $wheels: vendor it first (see README.md beside this script)"
    exit 2
fi
say "installing patch-dsv4 from $wheels (no index)"
"$python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" patch-dsv4

target=()
if [[ -n "${PATCH_DSV4_SITE_PACKAGES:-}" ]]; then
    target=(--site-packages "$PATCH_DSV4_SITE_PACKAGES")
fi

say "apply (opt-ins: ${PATCH_DSV4_WITH:-none})"
"$python" -m patch_dsv4 apply "${target[@]}"
say "verify"
"$python" -m patch_dsv4 verify "${target[@]}"
fingerprint="$("$python" -m patch_dsv4 status --fingerprint "${target[@]}")"
say "this node serves $fingerprint"
if [[ -n "${PATCH_DSV4_EXPECT:-}" ]]; then
    "$python" -m patch_dsv4 verify --expect "$PATCH_DSV4_EXPECT" "${target[@]}" >/dev/null
    say "it is the fingerprint PATCH_DSV4_EXPECT names"
fi
