"""GPU tests (marked gpu): the exllamav2 and exllamav3 engines and the gateway on real GPUs.

Run by scripts/gpu_run.sh on a CUDA host; skipped elsewhere.
"""
