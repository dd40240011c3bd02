"""mok_plugin's benchmarks: a library of their parts and the commands built from them.

Each module has one job:
  timing      CUDA-event timing after a settle period (SETTLE_S), median and p20-p80, slowest rank
  ceiling     the dense bf16 GEMM ceiling, measured in the same run
  families    the expert families by name (swiglu, gpt-oss, nemotron, glu-gelu, mlp-relu, ...)
  flops       the FLOP count of a pass, per expert family (SonicMoE's convention; BENCHMARKS.md, Method)
  floor       the fewest bytes a fwd+bwd moves, and the device-copy rate they are held against
  memory      what sets a pass's peak memory, from the caching allocator's trace
  breakdown   torch.profiler readers: GPU time per kernel, device time per named range
  providers   the layer's implementations under test (MoK, torch grouped_mm, Megatron, Liger), per family
  tuning      the short tile-config notation and the in-process override of the pinned table
  report      run metadata for the JSON (GPU, versions, commit, time)
  generic     DeepSpeed's own MoE against MoK's, for recognised and generic expert modules
  ab          one change (module settings, pinned tile configs) against the code as is, alternated in one process
  layer, ab, tune, inspect, ep, multi_gpu, generic   the commands: each has main(argv=None)

Nothing here is imported by `import mok_plugin`; the commands run as `mok bench ...` or through the
thin files in scripts/.
"""
