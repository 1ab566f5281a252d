"""Test-wide settings.

The suite runs as two pytest-xdist workers on a 2-core machine; each worker uses one torch
thread so the workers do not oversubscribe the cores (tiny matmuls with contended threads
run ~100x slower).
"""
import torch

torch.set_num_threads(1)
