"""``attnlab bench --device cuda`` (issue 34): on a machine without a GPU it refuses in one
line that says why; its table names the GPU and the ratio to torch's flash backend. The suite
itself runs only where a GPU is (BENCHMARKS.md says where it was run, and that it was not here)."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench import gpu
from attnlab.cli import main


def test_without_a_gpu_the_suite_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device here" in err and "--device cuda" in err
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        gpu.gpu_benchmark([128])


def test_the_table_names_the_gpu_and_the_ratio():
    rows = [{"L": 4096, "mode": "fwd", "causal": True, "dtype": "bfloat16", "impl": "attnlab-triton", "ms": 1.25,
             "tflops": 110.0, "x_flash": 1.5},
            {"L": 4096, "mode": "fwd", "causal": True, "dtype": "bfloat16", "impl": "torch-flash", "ms": 0.8333,
             "tflops": 165.0, "x_flash": 1.0}]
    text = gpu.gpu_table(rows, "NVIDIA H200")
    assert text.splitlines()[0] == "GPU: NVIDIA H200"
    assert "| 4096 | fwd | yes | bfloat16 | attnlab-triton | 1.250 | 110.0 | 1.50 |" in text
    assert "| torch-flash | 0.833 | 165.0 | 1.00 |" in text


def test_bad_device_is_named(capsys):
    assert main(["bench", "--device", "tpu"]) == 2
    assert "argument --device: invalid choice: 'tpu'" in capsys.readouterr().err
