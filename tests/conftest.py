import os

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def output_dir():
    """Where tests leave files for a person to look at (screenshots, logs)."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test-output")
    os.makedirs(path, exist_ok=True)
    return path
