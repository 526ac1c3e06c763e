"""GPU tests (marked gpu): exllamav2 engine and gateway on real GPUs, run by scripts/gpu_run.sh."""
