"""The peers benchmark: mlx_flash, mlx_lm and llama.cpp in one run, under one memory limit.

Every run of every system is its own process, started inside a fresh memory
cgroup (v1 `memory.limit_in_bytes`, or v2 `memory.max`) by a two-line shell
launcher that writes its own pid into `cgroup.procs` and then execs the
system, so the interpreter and the imports are counted from the first byte.
The page cache is dropped before every run (cold start), and the cgroup's
limit counts page cache too: a peer that memory-maps its weights (llama.cpp)
keeps re-reading them from disk when they do not fit, one that reads them
into anonymous memory (mlx_lm) is OOM-killed, and mlx_flash's planner is
told, through `memory_budget`, how much of the limit its weights may take.

The limit: "50%" (the default) gives each runtime its own baseline (the RSS of
a process that has imported the runtime but loaded no weights, measured once
per runtime in a probe run) plus 50 % of the model's float32 weights; a byte
count gives every system that limit; several limits ("50%,100%") run every
system at each. `system@none` runs a system without a limit (still in a
cgroup, so its peak is measured the same way).

mlx_flash's `memory_budget` counts weights only. By default (`--flash-budget
auto`) each limited mlx_flash system first runs once without a limit at the
full budget (limit - baseline); its peak RSS minus the weights its plan held is
what it needs besides weights, and its budget under the limit is the limit
minus that, minus 5 %. `full` passes limit - baseline as is.

Systems (the same prompt token ids for all, greedy, the end tokens forbidden
so that every system decodes exactly N tokens):

  mlx_flash:dense | mlx_flash:naive | mlx_flash:hybrid
  mlx_flash:flash:<sparsity>:<density>   e.g. mlx_flash:flash:dip:0.5
  mlx_lm                                 the flash folder exported to float32 HF
  llama.cpp-f32 | llama.cpp-f16 | llama.cpp-gguf (= llama.cpp-q4_1: the source GGUF as it is)
                                         llama-cpp-python in .venv-peers
                                         (`make peers-setup`); F32/F16 GGUFs
                                         written from the source GGUF with the
                                         same float16-rounded values as the
                                         flash folder

Per system: decode and prompt tokens/s, the cgroup's peak (page cache
included) and the process's peak RSS, bytes read from disk per decode token
(/proc/<pid>/io read_bytes, which counts O_DIRECT and mmap page-fault reads),
and whether the kernel's OOM killer ended it. Rounds alternate the order of
the systems; speeds are also given as the median per-round ratio to a
reference system.

The package (submodules import each other only downward, never the package):

  systems.py  System specs, --limit and --flash-budget; the constants. Imports
              errors and sizes only.
  cgroup.py   MemoryCgroupRunner / UnconstrainedRunner, drop_caches, loadavg.
              Imports errors only.
  files.py    the peers' model files: float32 size, HF export, F32/F16 GGUFs,
              the llama_cpp interpreter, the prompt ids. Imports errors (layout,
              loader, gguf, mlx_lm lazily, inside the functions).
  report.py   peers.md / peers.csv / peers.json and the formatting helpers.
              Imports systems.
  run.py      Peers (prepare, probe, calibrate, the rounds, the result),
              RunRecord, record_from. Imports systems, cgroup, files, report.
  child.py    one run of one system, started as a plain script (`python
              child.py CONFIG.json`, possibly by .venv-peers' interpreter):
              imports nothing of mlx_flash at the top, nothing of this package.
"""

from .cgroup import (  # noqa: F401
    ENTERED_FAILED,
    LAUNCHER,
    V1_ROOT,
    V2_ROOT,
    CgroupRun,
    CgroupUnavailable,
    MemoryCgroupRunner,
    UnconstrainedRunner,
    cgroup_support,
    drop_caches,
    loadavg,
)
from .files import (  # noqa: F401
    DEFAULT_GGUF,
    INSTRUCTION,
    PASSAGE,
    REPO,
    check_import,
    ensure_gguf,
    ensure_hf_export,
    llama_cpp_python,
    model_float32_bytes,
    peers_home,
    prompt_ids,
    source_gguf,
    write_float_gguf,
)
from .report import COLUMNS, markdown, write_csv, write_json  # noqa: F401
from .run import (  # noqa: F401
    BLAS_MODULE,
    CHILD,
    LLAMA_ENV,
    Peers,
    RunRecord,
    machine_info,
    read_events,
    record_from,
)
from .systems import (  # noqa: F401
    DEFAULT_MODEL,
    DEFAULT_SYSTEMS,
    GGUF_TYPES,
    MB,
    MLX_FLASH_MODES,
    RUNTIMES,
    SPARSITIES,
    SPEC_HELP,
    System,
    parse_flash_budget,
    parse_limit,
    parse_system,
    parse_systems,
)
