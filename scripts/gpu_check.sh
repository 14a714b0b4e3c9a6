#!/usr/bin/env bash
# The GPU run: on the H100 set up as ../shared/gpu/README.md says, run the
# chosen steps and write every report to results/ (or $OUT_DIR), stamped with
# the GPU name and commit; commit them. Steps (default: all), each well under
# the 10 minutes one device call may take:
#   tests       the whole test suite, GPU tests included -> gpu_tests.txt
#   gpu-tests   only the tests that run on the GPU (-k "cuda or gpu"), in parallel processes -> gpu_tests.txt
#   p22-tests   only the p22 tests that run on the GPU -> gpu_tests_p22.txt (this, layernorm-tests and
#               layernorm-linear-tests are a quick look: the committed record is gpu-tests' gpu_tests.txt)
#   direct-tests  the drop-in and direct-route GPU tests, which need no MAX on the machine -> gpu_tests_drop_in.txt
#               (committed from a machine of two GPUs: the multi-GPU tests' record)
#   layernorm-tests  only the layernorm tests that run on the GPU -> gpu_tests_layernorm.txt
#   layernorm-linear-tests  only the layernorm_linear tests that run on the GPU, each by name -> gpu_tests_layernorm_linear.txt
#   p22         the p22 solution, default and realistic sizes, per-kernel times, tiles-per-block sweeps -> p22.txt
#   dispatch    host cost of a bridge call -> host.{csv,md} (table bench_dispatch)
#   timing-tests  only the CUPTI kernel-time tests on the GPU -> gpu_tests_timing.txt
#   layernorm   LayerNorm benchmark -> layernorm.{csv,md,png} (table bench_layernorm)
#   layernorm:D1,D2  the same for those dtypes only, kept next to the CSV's other dtypes (to rerun one)
#   rmsnorm     RMSNorm benchmark (torch, torch.compile, Liger-Kernel where installed, ours) -> rmsnorm.{csv,md}
#               (table bench_rmsnorm)
#   rmsnorm-linear  RMSNorm+Linear benchmark (torch, torch.compile, ours) -> rmsnorm.{csv,md}
#               (table bench_rmsnorm_linear)
#   models      Hugging Face models patched by ops.apply_to, eager, compile and generate -> transformer.{csv,md}
#               (table bench_models; needs transformers)
#   layernorm-bwd-sweep  the LayerNorm backward's row groups x register configurations -> layernorm.* (bench_layernorm_bwd_sweep)
#   layernorm-linear  LayerNorm+Linear benchmark -> layernorm_linear.{csv,md,png} (table bench_layernorm_linear)
#   layernorm-linear:D1,D2  the same for those dtypes only, appended likewise
#   layernorm-linear-splits  the fused kernel's k-split sweep -> layernorm_linear.* (bench_layernorm_linear_splits)
#   layernorm-linear-sm90  the Hopper kernel beside torch, the default and cuBLAS -> layernorm_linear.* (bench_layernorm_linear_sm90)
#   layernorm-linear-sm90-quick  the same at SM90_SHAPES only (about 2 minutes)
#   layernorm-linear-workspace  the unfused forward's GEMM under each cuBLASLt workspace cap, bfloat16 grid
#               -> layernorm_linear.* (bench_layernorm_linear_workspace; about 3 minutes)
#   transformer  GPT-2-small with our drop-ins, eager, CUDA graph and compile, and the compile knobs' A/Bs
#               -> transformer.{csv,md,png} (tables bench_transformer*)
#   transformer-eager  its eager rows only, medians over 5 fresh processes (the 1x128 rows are host-bound and noisy)
#   transformer-compile  its compile rows only, likewise (host-bound too), and ours with training graphs in the
#               "inductor" form (bench_transformer_compiled_inductor_form); TRANSFORMER_REPEATS: rounds per process
#               of these three steps (default 11); TRANSFORMER_PIN_CORE: a CPU to pin their threads to while timed
#   transformer-cuda_graph  its CUDA-graph rows only, likewise, and ours captured on one stream (bench_transformer_capture_overlap)
#   transformer-breakdown  its captured calls' device time by kind of kernel (bench_transformer_breakdown*)
#   transformer-compile-kernels  its compiled calls' kernel launches and device time (torch, ours, ours without the
#               GELU epilogue), and every kernel (bench_transformer_compile_kernels{,_kernels})
#   transformer-control:MODE  torch's model against a copy of itself in MODE at 1x128, 5 processes of 31 rounds (the
#               noise floor of the ratios) (bench_transformer_control)
#   probe-captured-gemms  the fused modules' GEMMs at 1x128 in a CUDA graph: cuBLASLt's candidates, cold weights,
#               a triton GEMM and one with the LayerNorm in its prologue -> transformer.* (probe_captured_gemms)
#   profile-host  host time per call and torch.profiler's CPU table, torch against ours -> profile_host.md
#   ab-kernels  LayerNorm forward kernels against 0306017's on this GPU -> kernel_ab.* (kernel_ab_vs_0306017); needs
#               build/ab_0306017 from `python scripts/ab_kernels.py 0306017 --build` (a machine with Mojo) first
#   sanitize    compute-sanitizer memcheck + racecheck over every kernel -> sanitizer.txt
#
#   . /opt/maxsite/env.sh && bash scripts/gpu_check.sh [step...]
#
# Build the PTX ahead on the CPU machine and bring it along, or the GPU workers build it kernel by kernel and
# the suite runs past 10 minutes: OPS_CACHE_DIR=$PWD/build/ops_cache poe build-kernels (30 s), then carry
# build/ops_cache and export the same OPS_CACHE_DIR there. OpInfo tests need expecttest in torch's own
# environment: python -m pip install expecttest-*.whl.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT_DIR:-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OPS_CACHE_DIR="${OPS_CACHE_DIR:-/tmp/ops_cache}"
status=0
export OPS_COMMIT="${OPS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
stamp() { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit $OPS_COMMIT, $(date -u +%F)"; }
run() {  # run <report name> <command...>: tee the output into $out/<name>.txt (a benchmark's console, *_log*:
  # into $out/logs/, which is not committed: its numbers are in the family CSV), remember failures
  local name="$1" start=$SECONDS dest; shift
  case "$name" in *_log*) mkdir -p "$out/logs"; dest="$out/logs/$name.txt" ;; *) dest="$out/$name.txt" ;; esac
  { stamp; echo "\$ $*"; "$@"; } 2>&1 | tee "$dest"
  local rc=${PIPESTATUS[0]}
  echo "exit code: $rc (wall $((SECONDS - start)) s)" | tee -a "$dest"
  [ "$rc" -eq 0 ] || status=1
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests p22 dispatch layernorm layernorm-linear)
for step in "${steps[@]}"; do
  case "$step" in
    tests) run gpu_tests python -m pytest -q -rs -p no:cacheprovider tests ;;
    gpu-tests)  # in OPS_TEST_WORKERS processes (pytest-xdist; MAX's compiles dominate), then the kernel-timing
      # tests alone: their CUPTI timings must not share the GPU with other processes; then what the builds cost
      # (OPS_COMPILE_LOG, see bridge.built_once). GPU_TESTS_ARGS: more pytest arguments for the first run
      mkdir -p "$out/logs"; export OPS_COMPILE_LOG="$out/logs/gpu_tests_compiles.tsv"; : > "$OPS_COMPILE_LOG"
      run gpu_tests bash -c "python -m pytest -q -rs -p no:cacheprovider tests -k '(cuda or gpu) and not test_timing' \
        -n ${OPS_TEST_WORKERS:-12} --durations=15 ${GPU_TESTS_ARGS:-} \
        && python -m pytest -q -rs -p no:cacheprovider tests/test_timing.py -k gpu"
      awk -F'\t' '{n++; w += $2; h += $3; if (!seen[$4]++) d++} END {printf "builds: %d (%d distinct), %.0f s \
building, %.0f s waiting for another process\n", n, d, h, w}' "$OPS_COMPILE_LOG" | tee -a "$out/gpu_tests.txt"
      unset OPS_COMPILE_LOG ;;
    direct-tests) run gpu_tests_drop_in python -m pytest -q -rs -p no:cacheprovider tests/test_drop_in_*.py tests/test_multi_gpu.py \
      tests/test_routes.py tests/test_cuda_graphs.py tests/test_compile_gpu.py -k "(cuda or gpu) and not graph_route" --durations=8 ;;
    p22-tests) run gpu_tests_p22 python -m pytest -q -rs -p no:cacheprovider tests/test_p22.py -k "cuda or gpu" ;;
    layernorm-tests)
      run gpu_tests_layernorm python -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_layernorm.py -k "cuda or gpu" ;;
    layernorm-linear-tests)
      run gpu_tests_layernorm_linear python -m pytest -v -rfs --tb=short -p no:cacheprovider \
        tests/test_layernorm_linear.py tests/test_layernorm_linear_algos.py -k "cuda or gpu" ;;
    p22)
      run p22 bash -c "python scripts/p22.py --solution --unfused --fused \
        && python scripts/p22.py --solution --unfused --fused --batch 8 --seq 512 --hidden 768 --out 3072 --iters 100 --col-tiles-sweep \
        && python scripts/p22.py --solution --unfused --fused --col-tiles-sweep --batch 8 --seq 512 --hidden 768 --out 768 --iters 30 \
        && python scripts/p22.py --solution --unfused --fused --col-tiles-sweep --batch 4 --seq 1024 --hidden 1024 --out 4096 --iters 30 \
        && python scripts/p22.py --solution --fused --variant naive --batch 8 --seq 512 --hidden 768 --out 3072 --iters 5" ;;
    dispatch)
      run bench_dispatch_log python scripts/bench_dispatch.py
      [ "$out" = results ] || cp results/host.* "$out"/ ;;
    timing-tests) run gpu_tests_timing python -m pytest -q -rs -p no:cacheprovider tests/test_timing.py -k gpu ;;
    layernorm)
      run bench_layernorm_log python scripts/bench_layernorm.py
      [ "$out" = results ] || cp results/layernorm.* "$out"/ ;;
    layernorm:*)
      run "bench_layernorm_log_${step#*:}" python scripts/bench_layernorm.py --dtypes "${step#*:}" --append
      [ "$out" = results ] || cp results/layernorm.* "$out"/ ;;
    rmsnorm)
      run bench_rmsnorm_log python scripts/bench_rmsnorm.py
      [ "$out" = results ] || cp results/rmsnorm.* "$out"/ ;;
    rmsnorm-linear)
      run bench_rmsnorm_linear_log python scripts/bench_rmsnorm.py --linear --dtypes bfloat16
      [ "$out" = results ] || cp results/rmsnorm.* "$out"/ ;;
    models)
      run bench_models_log python scripts/bench_models.py --modes eager,compile,generate
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    layernorm-bwd-sweep)
      run bench_layernorm_bwd_sweep_log python scripts/bench_layernorm.py --bwd-sweep --dtypes bfloat16,float32
      [ "$out" = results ] || cp results/layernorm.* "$out"/ ;;
    layernorm-linear)
      run bench_layernorm_linear_log python scripts/bench_layernorm_linear.py
      [ "$out" = results ] || cp results/layernorm_linear.* "$out"/ ;;
    layernorm-linear:*)
      run "bench_layernorm_linear_log_${step#*:}" python scripts/bench_layernorm_linear.py --dtypes "${step#*:}" \
        --append
      [ "$out" = results ] || cp results/layernorm_linear.* "$out"/ ;;
    layernorm-linear-splits)
      run bench_layernorm_linear_splits_log python scripts/bench_layernorm_linear.py --splits --dtypes bfloat16,float32,float16
      [ "$out" = results ] || cp results/layernorm_linear.* "$out"/ ;;
    layernorm-linear-sm90|layernorm-linear-sm90-quick)
      quick=""; [ "$step" = layernorm-linear-sm90-quick ] && quick=--quick
      run bench_layernorm_linear_sm90_log python scripts/bench_layernorm_linear.py --sm90 $quick
      [ "$out" = results ] || cp results/layernorm_linear.* "$out"/ ;;
    layernorm-linear-workspace)
      run bench_layernorm_linear_workspace_log python scripts/bench_layernorm_linear.py --workspace
      [ "$out" = results ] || cp results/layernorm_linear.* "$out"/ ;;
    transformer)  # GPT-2-small, every mode, in one process, plus our LayerNorm ops and our Linear under compile
      run bench_transformer_log python scripts/bench_transformer.py --layernorm-ab --linear-ab --gelu-ab
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    transformer-eager|transformer-compile|transformer-cuda_graph)  # one mode, medians over 5 fresh processes (3-6 minutes)
      mode=${step#transformer-}
      ab=()   # the CUDA-graph rows also time ours with each capture knob off (bench_transformer.py CAPTURE_ABS),
      [ "$mode" = cuda_graph ] && ab=(--capture-overlap-ab)   # the compile rows ours with training graphs in the
      [ "$mode" = compile ] && ab=(--inductor-form-ab)         # "inductor" form (the default before "auto")
      pin=(); [ -n "${TRANSFORMER_PIN_CORE:-}" ] && pin=(--pin-core "$TRANSFORMER_PIN_CORE")
      run bench_transformer_${mode}_log python scripts/bench_transformer.py --modes $mode --processes 5 "${ab[@]}" \
        --repeats "${TRANSFORMER_REPEATS:-11}" "${pin[@]}"
      [ "$out" = results ] || cp results/transformer.* "$out"/
 ;;
    transformer-control:*)  # one mode at 1x128, with torch's second copy, medians over 5 fresh processes
      run bench_transformer_control_log python scripts/bench_transformer.py --modes "${step#transformer-control:}" \
        --control --sizes 1x128 --processes 5 --repeats 31
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    transformer-compile-kernels)  # about 3 minutes
      run bench_transformer_compile_kernels_log python scripts/bench_transformer.py --compile-kernels --gelu-ab
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    transformer-breakdown)  # about 2 minutes
      run bench_transformer_breakdown_log python scripts/bench_transformer.py --breakdown
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    probe-captured-gemms)  # about 75 s (triton compiles)
      run probe_captured_gemms_log python scripts/probe_captured_gemms.py
      [ "$out" = results ] || cp results/transformer.* "$out"/ ;;
    profile-host)  # where the host's time goes per call, torch against ours (about a minute)
      OUT_DIR="$out" run profile_host_log python scripts/profile_host.py ;;
    ab-kernels)  # about 3 minutes
      run kernel_ab_log python scripts/ab_kernels.py 0306017
      [ "$out" = results ] || cp results/kernel_ab.* "$out"/ ;;
    sanitize)
      export PATH="$PATH:/usr/local/cuda/bin"
      python scripts/sanitize_workload.py > /dev/null  # compile outside the sanitizer first
      # API errors off: cuda-bindings resolves driver entry points through cuGetProcAddress, whose handled misses
      # memcheck counts as errors (34 at bcdd6d5); device memory errors are what this step is for
      run sanitizer bash -c "compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        --print-limit 20 python scripts/sanitize_workload.py && compute-sanitizer --tool racecheck --error-exitcode 1 \
        --print-limit 20 python scripts/sanitize_workload.py" ;;
    *) echo "unknown step: $step"; status=1 ;;
  esac
done
exit $status
