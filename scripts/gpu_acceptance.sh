#!/usr/bin/env bash
# The single-GPU acceptance runs of the open issues, in one call on a CUDA machine:
#   tests      the GPU test modules (layer vs reference, bitwise, torch.compile at one and several token counts
#              and with experts run eagerly between graphs, CUDA graphs, EP transports,
#              the Gluon weight gradients on Hopper)
#              and the kernel, op and empty-work tests compiled, and Megatron's own MoE layer tests with MoK
#              (their CUDA cases), in one pytest run
#              (spread over the cores with pytest-xdist where installed: compiling the kernels is CPU-bound)
#   compare    scripts/compare.py on the single-H200 config, through Megatron and through DeepSpeed
#              (the DeepSpeed one is stock vs MoK under deepspeed.initialize: tokens/s, memory, losses)
#   layer      scripts/bench_layer.py (mok bench layer) on the four named shapes, each in its own process:
#              both MoK variants, the PyTorch path and Megatron's stock layer; on all but deepseek-v3 also
#              Liger's fused MoE, with its autotuning off (LIGER_FUSED_MOE_AUTOTUNE=0 unless set: tuned, it
#              takes ~4 minutes per shape); deepseek-v3 with 6 iterations instead of 10
#   deepspeed  DeepSpeed's own MoE tests (tests/test_deepspeed_upstream.py: the fp16 cases need CUDA) and
#              scripts/compare.py --framework deepspeed on the Megatron-DeepSpeed GPT-MoE-like config
#   ep-overlap scripts/ep_overlap.py (mok bench ep-overlap): Megatron's EP-overlap schedule through
#              scripts/pretrain_gpt.py, two EP ranks sharing the GPU over gloo; stock and MoK, plain,
#              --overlap-moe-expert-parallel-comm, and with --delay-wgrad-compute too (needs TE)
#   perf       issue 24's table, one process per shape, MoK (multi-kernel) against the PyTorch path, settled:
#              perf-coarse  gpt-oss-120b (H, I not multiples of 128) and three shapes of the issue's class:
#                           4096,7168,2048,384,8 (E 384, Kimi-K2-like), 4096,7168,2048,256,8 (deepseek-v3's
#                           dimensions at T = 4096: both with h per pair) and 8192,3000,1000,160,6 (odd H and I)
#              perf-small   qwen3-30b-a3b's dimensions at T = 1, 37, 512, 4096, uniform and skewed routing,
#                           3 rounds of the two providers in turn (host-bound: the host's speed drifts)
#              perf-graphs  the same T = 1, 37, 512 with forward + backward also replayed from a CUDA graph
#                           (--graphs): the GPU's time without the host's, against the floor of writing
#                           every expert's weight gradient
#              perf-host    T = 1, 37, 512 uniform, 3 rounds of both MoK variants and the PyTorch path, with
#                           --host-profile: where the host's time goes, and whether the megakernel's three
#                           launches a step (against the multi-kernel's eleven) pay at small T; and `mok bench host
#                           --cuda`: a step's host time with direct launches against Triton's own path
#              (the named shapes are the `layer` part); each takes a call of its own on the H200
#   rows-probe v47's Gluon row kernel alone (`mok bench rows`): fc2's forward and fc1's dgrad, the
#              pinned Triton kernels against the Gluon kernel's tile orders and a deeper 128-wide ring, bits
#              compared, on six shapes, one process each; and its GPU tests (the grouped order) first
#   untimed    the changes written without a GPU and switched off until timed (BENCHMARKS.md's prediction rows
#              that say "not yet timed"): their GPU tests (untimed-tests); the candidates (untimed-candidates:
#              `mok bench ab`'s arguments, --set or --override each, ~100 s each; a null A/B, the method's
#              check, then v48 on six shapes); each switch
#              A/B'd at qwen3-30b-a3b's dimensions, T = 1, 37, 512, under graphs, all of them together, and eager
#              at T = 1 and 37 (untimed-small). untimed-ab is the candidates, then the small batches. Edit the
#              lists as switches and candidates come and go (session 48 timed v38, landed, and v39, removed;
#              session 51 timed v41, removed; session 54 v45, removed; session 55 wrote v47, session 57 timed it:
#              kept off; session 58 found its tile order, v48; session 59 wrote v49: its launches direct, and only
#              where its tiles fill a wave of the SMs).
#              The host-bound eager parts (perf-small, perf-host, untimed-all-eager) run with --no-clock: no
#              nvidia-smi process beside a timing that is the host's
#   families   scripts/bench_layer.py --expert on qwen3-30b-a3b and mixtral-8x7b (one process each): every
#              fused expert family, MoK against the PyTorch path written for that family
#   fp8        issue 25: the FP8 test modules compiled; scripts/bench_fp8.py on qwen3-30b-a3b, mixtral-8x7b and
#              deepseek-v3 (one process each: FP8 vs bf16 time, errors against float64 and the separate-cast
#              peer); fc2's dgrad epilogue's tile choices on qwen3-30b-a3b (--sweep down_dgrad_epilogue); the
#              harness for 200 steps with --fp8 e4m3 on the single-H200 config
#   fp8-hopper issue 25's Gluon kernels (kernels/fp8_hopper.py, on by default): tests/test_fp8_hopper.py, then
#              scripts/bench_fp8.py --hopper on the same three shapes (one process each: the weight gradients
#              and row GEMMs on the Triton kernels and on the Gluon ones, fc1 fused and split, bits compared);
#              fp8-hopper-tests and fp8-hopper-bench run one half each (if one call cannot hold both)
# Needs torch, triton, megatron-core, deepspeed and pydantic importable. On a machine without a registry
# (this project's device) carry the wheels of .whl/, made on a machine with one by `bash scripts/device_wheels.sh`
# (~8 MB, git-ignored): where the imports fail, this script installs them into a folder of its own first.
# GPU_ACCEPTANCE_BUDGET=SECONDS bounds the whole run: each part is killed when the budget runs out and the parts
# after it are listed as skipped, so that a device call's limit never takes the summary with it.
# The JSON names the commit from the copy's .git; where that may be stale (a device copy), run with
# MOK_COMMIT=<the commit sent> (bench/report.py).
# Usage: bash scripts/gpu_acceptance.sh [PART...]   (default: all parts; logs and JSON under $OUT or out/)
# On the H200 (2026-12-02): tests ~190 s with pytest-xdist, layer ~140 s (four processes); compare ~190 s
# (2026-11-30): more than one 10-minute device call holds, so split them, e.g. `tests layer` and `compare`.
# On an 80 GB H100 (2026-12-07, 6 workers): tests 426 s, perf-graphs 80 s: `tests` leaves room for little else.
# Each part's log is kept whole under the output folder; the summary lines print last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the parts' paths are the repository's
out="${OUT:-out}/acceptance"
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests compare layer)
budget=${GPU_ACCEPTANCE_BUDGET:-0}  # seconds for the whole run; 0: no bound
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
imports="import pydantic, yaml, tqdm, megatron.core, deepspeed"
if ! python3 -c "$imports" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/mok-acceptance-site"
    echo "==> installing the carried wheels (.whl/) into $site"
    python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl >"$out/wheels.log" 2>&1 ||
        { tail -n 5 "$out/wheels.log" >&2; exit 2; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# Fail in a second, not after minutes of device time, when a dependency is missing.
if ! missing=$(python3 -c "$imports" 2>&1); then
    echo "gpu_acceptance.sh: a dependency is not importable (see the header for the carried wheels):" >&2
    echo "$missing" | tail -n 1 >&2
    exit 2
fi
summary=()
# The switches written without a GPU and off until timed at the layer (the untimed part). v47 (fc2's forward and
# fc1's dgrad on the Gluon row kernel, session 55) was timed in session 57 and kept off (BENCHMARKS.md, "v47 timed
# at the layer on seven shapes"); its A/B sets
# "mok_plugin.kernels.grouped_mlp.HOPPER_ROW_GEMMS=('down_fwd','gate_up_dgrad')". v48 (session 58) found its
# losses on wide outputs in its tile order: in the Triton kernels' (rows_hopper.GROUP_M = 8, now its default) the
# two GEMMs alone beat Triton's on three of four shapes (the rows-probe part). Not yet timed at the layer beyond two
# eager A/Bs: the candidates below, and the switch at small batches here, where v49 (session 59) keeps it on Triton
# below a wave of tiles (T = 1) and launches it directly (tests/test_gpu_rows_hopper.py's direct-launch test in
# untimed-tests checks the bits).
untimed_switches=("mok_plugin.kernels.grouped_mlp.HOPPER_ROW_GEMMS=('down_fwd','gate_up_dgrad')")

# pytest-xdist spreads the kernel compiles (CPU-bound) over the cores where it is installed: `spread_over N`
# sets `spread` to N workers, sized for the H200's 141 GB, half of them on a GPU under 100 GB (12 ran an
# 80 GB H100 out of memory in session 49); without xdist the tests run one after the other.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
spread_over() {
    local workers=$1
    [[ "$gpu_mib" =~ ^[0-9]+$ ]] && [ "$gpu_mib" -lt 100000 ] && workers=$((workers / 2))
    spread=()
    python3 -c "import xdist" 2>/dev/null && spread=(-n "$workers")
}

run_part() {  # name, command...
    local name=$1
    shift
    local start=$SECONDS limit=()
    if [ "$budget" -gt 0 ]; then
        local left=$((budget - SECONDS))
        if [ "$left" -lt 10 ]; then
            summary+=("$(printf '%-22s skipped: GPU_ACCEPTANCE_BUDGET (%ss) spent' "$name" "$budget")")
            return
        fi
        limit=(timeout -s KILL "$left")
    fi
    "${limit[@]}" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local note=""
    [ "$rc" -eq 137 ] && [ "$budget" -gt 0 ] && [ $((budget - SECONDS)) -lt 10 ] && note="  (killed: the budget ran out)"
    summary+=("$(printf '%-22s rc=%-3s %4ss%s' "$name" "$rc" "$((SECONDS - start))" "$note")")
}

for part in "${parts[@]}"; do
    case $part in
    tests)
        spread_over 12  # ~3 minutes on the H200
        run_part tests python3 -m pytest -q "${spread[@]}" -p no:cacheprovider tests/test_gpu_layer.py \
            tests/test_gpu_parallel.py tests/test_empty_work.py tests/test_layer.py tests/test_kernels_grouped_mlp.py \
            tests/test_kernels_megakernel.py tests/test_kernels_combine.py tests/test_kernel_configs.py \
            tests/test_ops.py tests/test_parallel_multi_gpu.py tests/test_megatron_distributed_optimizer.py tests/test_wgrad.py \
            tests/test_schedule.py tests/test_gpu_wgrad_hopper.py tests/test_compact_h.py tests/test_kernel_launch.py \
            tests/test_bench_host.py tests/test_compile_eager_parts.py tests/test_deepspeed_structure.py \
            tests/test_fp8_hopper.py tests/test_mxfp8_mma.py tests/test_gpu_rows_hopper.py tests/test_megatron_upstream.py ;;
    compare)
        cfg=configs/topologies/qwen3-30b-a3b-4-layers_h200_single.yaml
        run_part compare-megatron python3 scripts/compare.py --config "$cfg" --out "$out/compare-megatron"
        run_part compare-deepspeed python3 scripts/compare.py --config "$cfg" --framework deepspeed \
            --out "$out/compare-deepspeed" ;;
    deepspeed)
        # DeepSpeed's own MoE tests with MoK substituted, the fp16 cases included (they need CUDA), and the
        # harness on a Megatron-DeepSpeed GPT-MoE-like model (GeLU experts with biases, top-1, dropping, RTS).
        # The ranks (2 or 4) share the GPU over gloo; TORCH_CUDA_ARCH_LIST=9.0 for the FusedAdam JIT
        # build (DeepSpeed 0.19.8's builder cannot parse an arch list with "9.0a").
        spread_over 6
        TORCH_CUDA_ARCH_LIST=9.0 run_part deepspeed-upstream python3 -m pytest -q "${spread[@]}" -p no:cacheprovider \
            -rs tests/test_deepspeed_upstream.py
        run_part compare-ds-gpt-moe python3 scripts/compare.py --framework deepspeed \
            --config configs/topologies/megatron-deepspeed-gpt-moe_h200_single.yaml --out "$out/compare-ds-gpt-moe" ;;
    ep-overlap)
        run_part ep-overlap python3 scripts/ep_overlap.py --out "$out/ep-overlap" ;;
    layer)
        # One process per shape: no allocator state or clock history carries over from the shape before.
        for shape in qwen3-30b-a3b olmoe mixtral-8x7b deepseek-v3; do
            providers=(mok-multi mok-mega torch megatron liger) iters=10
            [ "$shape" = deepseek-v3 ] && providers=(mok-multi mok-mega torch megatron) iters=6
            LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0} run_part "layer-$shape" python3 \
                scripts/bench_layer.py --shapes "$shape" --providers "${providers[@]}" --iters "$iters" \
                --out "$out/layer-$shape"
        done ;;
    perf-graphs)
        for tokens in 1 37 512; do
            run_part "perf-graphs-T$tokens" python3 scripts/bench_layer.py --shape "$tokens,2048,768,128,8" \
                --routing uniform skewed --providers mok-multi torch --iters 20 --graphs \
                --out "$out/perf-graphs-T$tokens"
        done ;;
    perf-host)
        for tokens in 1 37 512; do
            run_part "perf-host-T$tokens" python3 scripts/bench_layer.py --shape "$tokens,2048,768,128,8" \
                --routing uniform --providers mok-multi mok-mega torch --iters 20 --rounds 3 --host-profile --no-clock \
                --out "$out/perf-host-T$tokens"
        done
        run_part perf-host-launch python3 -m mok_plugin.cli bench host --cuda --tokens 1 37 512 --steps 300 \
            --repeats 5 ;;
    perf | perf-coarse | perf-small)
        if [ "$part" != perf-small ]; then
            for shape in 16384,2880,2880,128,4 4096,7168,2048,384,8 4096,7168,2048,256,8 8192,3000,1000,160,6; do
                # as BENCHMARKS.md's current table: the largest shapes' peaks without fragmentation
                PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
                run_part "perf-${shape//,/x}" python3 scripts/bench_layer.py --shape "$shape" --providers mok-multi torch \
                    --iters 10 --out "$out/perf-${shape//,/x}"
            done
        fi
        if [ "$part" != perf-coarse ]; then
            for tokens in 1 37 512 4096; do
                run_part "perf-small-T$tokens" python3 scripts/bench_layer.py --shape "$tokens,2048,768,128,8" \
                    --routing uniform skewed --providers mok-multi torch --iters 20 --rounds 3 --no-clock \
                    --out "$out/perf-small-T$tokens"
            done
        fi ;;
    rows-probe)
        # v47's Gluon row kernel alone against the Triton row GEMMs, one process a shape: tile order and ring depth
        spread_over 6
        run_part rows-probe-tests python3 -m pytest -q "${spread[@]}" -p no:cacheprovider tests/test_gpu_rows_hopper.py \
            -k group8
        for shape in deepseek-v3 16384,2880,2880,128,4 mixtral-8x7b 8192,3000,1000,160,6 qwen3-30b-a3b \
            4096,2048,768,128,8; do
            PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
            run_part "rows-probe-${shape//,/x}" python3 -m mok_plugin.cli bench rows --shape "$shape" \
                --out "$out/rows-probe-${shape//,/x}.json"
        done ;;
    untimed | untimed-tests | untimed-ab | untimed-candidates | untimed-small)
        if [ "$part" = untimed ] || [ "$part" = untimed-tests ]; then
            spread_over 12
            run_part untimed-tests python3 -m pytest -q "${spread[@]}" -p no:cacheprovider tests/test_gpu_layer.py \
                tests/test_kernels_grouped_mlp.py tests/test_compact_h.py tests/test_kernel_launch.py \
                tests/test_gpu_rows_hopper.py -k "sweep or compact or per_pair or pair_map or on_the_gpu or hopper_rows or not_chosen"
        fi
        if [ "$part" != untimed-tests ] && [ "$part" != untimed-small ]; then
            # The candidates first (what the next session asks first, so that a budget cuts the rest): a
            # null A/B (B sets an attribute to its own value: every B/A 1.00 +- 0.02 and the sides'
            # clocks within ~20 MHz show the method settled; session 52's three: 0.985-1.012 on every GEMM,
            # 4-15 MHz; session 57's 0.998; BENCHMARKS.md, "The A/B's clock again"). Add a candidate's
            # `mok bench ab` arguments before it (session 57 ran v47 here on seven shapes; now v48 on the six
            # shapes session 58 did not A/B at the layer).
            null="--set mok_plugin.kernels.configs.SWEEP_MAX_ROWS=1024"
            v48="--set mok_plugin.kernels.grouped_mlp.HOPPER_ROW_GEMMS=('down_fwd','gate_up_dgrad')"
            candidates=("--shape deepseek-v3 $null")
            for shape in deepseek-v3 mixtral-8x7b olmoe 8192,3000,1000,160,6 4096,7168,2048,384,8 4096,2048,768,128,8; do
                candidates+=("--shape $shape $v48")
            done
            for i in "${!candidates[@]}"; do
                # shellcheck disable=SC2086  # a candidate is a string of arguments, split on purpose
                run_part "untimed-candidate-$i" python3 -m mok_plugin.cli bench ab ${candidates[$i]} \
                    --out "$out/untimed-candidate-$i"
            done
        fi
        if [ "$part" != untimed-tests ] && [ "$part" != untimed-candidates ]; then
            # Each switch at small batches (qwen3-30b-a3b's dimensions, T = 1, 37, 512) under graphs, all of them
            # together, and together eager at T = 1 and 37 (where the host's time is the step's).
            sets=()
            for switch in "${untimed_switches[@]}"; do
                sets+=(--set "$switch")
                name=${switch%%=*}
                for tokens in 1 37 512; do
                    run_part "untimed-${name##*.}-T$tokens" python3 -m mok_plugin.cli bench ab \
                        --shape "$tokens,2048,768,128,8" --graphs --set "$switch" --out "$out/untimed-${name##*.}-T$tokens"
                done
            done
            if [ ${#sets[@]} -gt 0 ]; then
                for tokens in 1 37 512; do
                    run_part "untimed-all-T$tokens" python3 -m mok_plugin.cli bench ab \
                        --shape "$tokens,2048,768,128,8" --graphs "${sets[@]}" --out "$out/untimed-all-T$tokens"
                done
                for tokens in 1 37; do  # eager: the host's share (the switches' host work included)
                    run_part "untimed-all-eager-T$tokens" python3 -m mok_plugin.cli bench ab \
                        --shape "$tokens,2048,768,128,8" "${sets[@]}" --rounds 6 --no-clock \
                        --out "$out/untimed-all-eager-T$tokens"
                done
            fi
        fi ;;
    families)
        families=(swiglu swiglu-bias gpt-oss glu-gelu glu-gelu-tanh glu-quick-gelu glu-relu mlp-silu mlp-gelu
                  mlp-gelu-tanh mlp-quick-gelu mlp-relu mlp-squared-relu)
        for shape in qwen3-30b-a3b mixtral-8x7b; do
            run_part "families-$shape" python3 scripts/bench_layer.py --shapes "$shape" --expert "${families[@]}" \
                --providers mok-multi torch --iters 10 --out "$out/families-$shape"
        done ;;
    fp8)
        spread_over 12
        run_part fp8-tests python3 -m pytest -q "${spread[@]}" -p no:cacheprovider tests/test_fp8.py \
            tests/test_fp8_kernels.py tests/test_fp8_reference.py tests/test_fp8_layer.py tests/test_megatron_fp8.py \
            tests/test_fp8_hopper.py tests/test_mxfp8_mma.py
        for shape in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
            run_part "fp8-$shape" python3 scripts/bench_fp8.py --shapes "$shape" --out "$out/fp8-$shape"
        done
        run_part fp8-epilogue-sweep python3 scripts/bench_fp8.py --shapes qwen3-30b-a3b --sweep down_dgrad_epilogue \
            --out "$out/fp8-epilogue-sweep"
        run_part fp8-compare python3 scripts/compare.py --config configs/topologies/qwen3-30b-a3b-4-layers_h200_single.yaml \
            --fp8 e4m3 --steps 200 --out "$out/fp8-compare" ;;
    fp8-hopper | fp8-hopper-tests | fp8-hopper-bench)
        if [ "$part" != fp8-hopper-bench ]; then
            spread_over 8
            run_part fp8-hopper-tests python3 -m pytest -q "${spread[@]}" -p no:cacheprovider tests/test_fp8_hopper.py
        fi
        if [ "$part" != fp8-hopper-tests ]; then
            for shape in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
                run_part "fp8-hopper-$shape" timeout 300 python3 scripts/bench_fp8.py --shapes "$shape" --hopper \
                    --out "$out/fp8-hopper-$shape"
            done
        fi ;;
    *) echo "unknown part: $part" >&2 && exit 2 ;;
    esac
done

for log in "$out"/*.log; do
    echo "==== $(basename "$log") (tail)"
    tail -n 15 "$log"
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
