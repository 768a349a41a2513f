#!/bin/bash
# Two trees measured in one call on the GPU machine, alternating: .ab/old (prepare it here with
#   mkdir -p .ab/old && git archive REV | tar -x -C .ab/old; echo /.ab/ >> .git/info/exclude
# and carry `.whl` and `.ab`) and this tree. Each is installed editable in turn (the wheels of
# ../shared/gpu/wheels.sh first), then runs the gpu_suite steps named in STEPS (default: the Qwen3-0.6B
# throughput and the 8B batch-1 decode), ROUNDS times. Prints one line per tree and round.
set -u
STEPS=${STEPS:-"throughput-qwen3-0.6b decode-8b"}
ROUNDS=${ROUNDS:-2}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
export PYTHONUNBUFFERED=1
install() {
  (cd "$1" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . $(printf -- "-e %s " plugins/*) \
    -e backends/cpu -e backends/cuda > "$OUT/install-$2.log" 2>&1) || { tail "$OUT/install-$2.log"; exit 1; }
}
for round in $(seq "$ROUNDS"); do
  for tree in old new; do
    dir=.ab/old; [ $tree = new ] && dir=.
    install $dir $tree
    (cd $dir && python3 benchmarks/gpu_suite.py "$OUT/$tree-$round" --only $STEPS --timeout 170 \
      | grep -o '[a-z_]*output_tok_s": [0-9.]*\|decode_tok_s": [0-9.]*\|"256": {[^}]*}' | tr '\n' ' ' | sed "s/^/$tree round $round: /"; echo)
  done
done
