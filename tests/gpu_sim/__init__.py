"""CUDA kernels simulated on CPU: test doubles that enforce the real kernels' contracts."""
