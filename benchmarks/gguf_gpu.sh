#!/bin/bash
# #37's GPU figures in a few calls on one warm GPU machine (carry `.whl` and `.ab`), each under 600 s:
#   bash benchmarks/gguf_gpu.sh kernels   # the kernel table, while llama.cpp builds
#   bash benchmarks/gguf_gpu.sh dequant   # the dequantize kernel's tiles alone
#   bash benchmarks/gguf_gpu.sh models    # llama.cpp's llama-bench / llama-batched-bench (when built), then xinfer
#   bash benchmarks/gguf_gpu.sh tiles     # every candidate tile of the planes at 16 and 64 rows
#   bash benchmarks/gguf_gpu.sh planes    # the plane and block kernels' tests
#   bash benchmarks/gguf_gpu.sh packed    # the packed-weight model tests (llama-cpp-python CPU-only for the mixes)
# Prepare here: ../shared/gpu/wheels.sh diskcache (into .whl), and llama.cpp's source under the carry limit:
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lsd && cd /tmp/lsd && tar xzf llama_*.tar.gz
#   cd llama_cpp_python-0.3.36/vendor/llama.cpp && rm -rf docs models/*.gguf* media benches \
#     ggml/src/ggml-{et,metal,hexagon,sycl,vulkan,opencl,cann,musa,webgpu,zdnn,openvino}
#   cd /tmp/lsd && tar czf $REPO/.ab/llama_cpp_python-0.3.36-slim.tar.gz llama_cpp_python-0.3.36   # (49 MB)
# LIMIT=SECONDS caps a mode's runs (each has its own default); BATCHES="1 16 64" the batch sizes of tiles and models. Writes its logs and JSON under $OUT; prints the JSON lines and the tests' last lines.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
[ -e /tmp/lcpy ] && export PYTHONPATH=/tmp/lcpy:$PYTHONPATH
if ! python3 -c 'import xinfer_cuda' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . $(for p in plugins/*/ backends/cpu/ \
    backends/cuda/; do echo "-e $p"; done) > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
fi
timed() {  # NAME SECONDS COMMAND...: the command's output in $OUT/NAME.txt, its exit code and seconds printed
  local name=$1 secs=$2 start; start=$(date +%s); shift 2
  timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - start ))s"
}
case ${1:-} in
kernels)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  mkdir -p /tmp/lsd && tar xzf .ab/llama_cpp_python-0.3.36-slim.tar.gz -C /tmp/lsd
  (start=$(date +%s)
   cmake -S /tmp/lsd/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcb -DGGML_CUDA=on \
     -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
     && cmake --build /tmp/lcb -j 10 --target llama-bench llama-batched-bench
   echo "llama.cpp built in $(( $(date +%s) - start )) s"
   CMAKE_ARGS="-DGGML_CUDA=off -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install -q --no-index \
     --no-deps --no-build-isolation --target /tmp/lcpy /tmp/lsd/llama_cpp_python-0.3.36
   echo "llama-cpp-python (CPU) built in $(( $(date +%s) - start )) s") > "$OUT/build.log" 2>&1 &
  build=$!
  (cd benchmarks && python3 -c 'from pathlib import Path; import quant_decode as q
for s in q.SCHEMES: q.gguf_file(q.SHAPES["llama-3.1-8b"](), s, Path("/tmp/quant_decode"))') > "$OUT/ggufs.log" 2>&1 &
  ggufs=$!
  timed kernels ${LIMIT:-300} python3 benchmarks/quant_decode.py --kernels --out "$OUT/kernels.json"
  grep -h '^{' "$OUT/kernels.txt"
  wait $ggufs; tail -2 "$OUT/ggufs.log"; wait $build; tail -2 "$OUT/build.log" ;;
dequant)
  timed dequant ${LIMIT:-150} python3 benchmarks/quant_decode.py --dequant --out "$OUT/dequant.json"
  grep -h '^{' "$OUT/dequant.txt" ;;
models)
  [ -e /tmp/lcb/bin ] && timed llama_cpp ${LIMIT:-120} python3 benchmarks/quant_decode.py --llama-cpp /tmp/lcb/bin \
    --batches ${BATCHES:-1 16 64} --out "$OUT/llama_cpp.json"
  timed xinfer ${LIMIT:-440} python3 benchmarks/quant_decode.py --model --batches ${BATCHES:-1 16 64} \
    --out "$OUT/xinfer.json"
  grep -h '^{' "$OUT"/llama_cpp.txt "$OUT/xinfer.txt" 2>/dev/null ;;
tiles)
  timed tiles ${LIMIT:-300} python3 benchmarks/quant_decode.py --tiles --batches ${BATCHES:-16 64} --out "$OUT/tiles.json"
  tail -n 160 "$OUT/tiles.txt" | grep -v '^{' ;;
planes)
  timed planes ${LIMIT:-270} python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=250 -rs \
    tests/backends/test_plane_i8_gemv.py tests/backends/test_plane_i8_dot.py tests/backends/test_gguf_planes.py \
    tests/backends/test_gguf_kernels.py
  tail -n 4 "$OUT/planes.txt" ;;
packed)
  timed packed ${LIMIT:-330} python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=250 -rs \
    tests/gpu/test_gguf_packed.py tests/gpu/test_packed_weights_cuda.py \
    $([ -e /tmp/lcpy ] && echo tests/gpu/test_llama_cpp_mixes_cuda.py)
  tail -n 4 "$OUT/packed.txt" ;;
*) echo "usage: bash benchmarks/gguf_gpu.sh kernels|dequant|tiles|models|planes|packed"; exit 2 ;;
esac
