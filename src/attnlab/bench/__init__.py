"""``attnlab bench``: attnlab's attention against torch's, timed in the same run.

Four implementations: attnlab's reference (``reference``), attnlab's tiled path
(``tiled``), and torch SDPA pinned to its MATH (``math``) and FLASH_ATTENTION
(``flash``) backends. For each configuration (length, forward or forward+backward,
causal or not, dtype) every implementation is warmed up, then timed in interleaved
rounds (reference, tiled, math, flash, reference, ...) so that a noisy neighbour
slows all of them alike; the median is reported with GFLOP/s and the ratio to
torch's fastest backend *in the same run*. Peak memory is measured separately,
each configuration in a fresh process: how far one step raises the peak resident
memory (``VmHWM``) above the process's size after a small warm-up run and the
inputs ("peak +MiB").

Configurations whose O(L^2) score tensors would not fit the memory budget are
skipped and say so.

The package, a module per concern (the CLI, ``attnlab.cli.bench``, only parses and prints):

* :mod:`.timing`: configurations, the implementations, inputs and masks, :func:`run_benchmarks`;
* :mod:`.memory`: one step's peak resident memory (``VmHWM``), in a fresh process per case;
* :mod:`.machine`: the CPU line, the read bandwidth and the FMA peak, measured in the same run;
* :mod:`.suites`: density, transformers, a compiled model's step, decoding, float32 GEMM routes, bf16, block-mask building, the ring;
* :mod:`.peers`: OpenVINO's and ONNX Runtime's attention ops against attnlab and torch (``--peers``);
* :mod:`.tables`: Markdown, CSV, the plot, and each table's header;
* :mod:`.ranks`: the local-rank launcher behind ``attnlab ring`` and the ring suites (it spawns
  processes and injects faults for the tests: a harness, not library code).
"""

from __future__ import annotations

from attnlab.bench.timing import (  # noqa: F401
    IMPLS,
    TORCH_IMPLS,
    DTYPES,
    Config,
    Result,
    MASKS,
    VARIANTS,
    parse_mask,
    run_benchmarks,
    estimate_seconds,
    format_duration,
    measure_peak_memory,
)
from attnlab.bench.memory import (  # noqa: F401
    peak_rss_growth,
)
from attnlab.bench.machine import (  # noqa: F401
    read_bandwidth,
    machine_line,
    fma_peak,
    bf16_peak,
    compute_peak,
    peaks_for,
)
from attnlab.bench.tables import (  # noqa: F401
    ring_table,
    RING_HEADER,
    transformers_table,
    COMPILE_HEADER,
    compile_table,
    density_table,
    write_csv,
    markdown_table,
    plot,
    DECODE_HEADER,
    decode_table,
    GEMM_HEADER,
    gemm_table,
    PEERS_HEADER,
    peers_table,
    BF16_HEADER,
    bf16_table,
    MASK_KINDS,
    MASK_BUILDERS,
    BLOCK_MASK_HEADER,
    block_mask_table,
    RING_MASK_HEADER,
    ring_masks_table,
)
from attnlab.bench.peers import (  # noqa: F401
    PEERS,
    missing_peers,
    peers_benchmark,
)
from attnlab.bench.generation import (  # noqa: F401
    GENERATE_HEADER,
    GENERATE_LENS,
    generation_benchmark,
    generation_table,
)
from attnlab.bench.suites import (  # noqa: F401
    DENSITIES,
    density_sweep,
    HF_CASES,
    transformers_benchmark,
    COMPILE_LENS,
    compile_benchmark,
    decode_benchmark,
    BF16_SHAPES,
    bf16_benchmark,
    block_mask_benchmark,
    ring_masks_benchmark,
    ring_benchmark,
    gemm_benchmark,
)

__all__ = ["Config", "Result", "run_benchmarks", "write_csv", "plot", "markdown_table", "IMPLS"]
