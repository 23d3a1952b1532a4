"""mlx_flash.doctor (issue 14 item 4): the lines a bug report wants, and warnings that say what to do."""

import json
import os
import subprocess
import sys

import pytest


def _doctor(*args, home=None, env=None):
    env = os.environ | ({"MLX_FLASH_HOME": str(home)} if home else {}) | (env or {})
    return subprocess.run([sys.executable, "-m", "mlx_flash", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_doctor_reports_the_machine(tmp_path):
    r = _doctor("--no-probe", home=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for key in ("mlx_flash", "python", "platform", "ram", "mlx device", "blas", "reader pool", "checksums", "quantized kernels",
                "disk free", "uncached reads", "machine profile"):
        assert any(line.startswith(key + " ") for line in r.stdout.splitlines()), (key, r.stdout)
    # a fresh home has no machine profile: said, with the command that measures one
    assert "warning: no current machine profile" in r.stdout and "mlx_flash.benchmark profile" in r.stdout
    assert not list(tmp_path.glob(".doctor-probe*"))  # (its probe file removed)


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="the kernels' workers are pinned on Linux, with two CPUs or more")
def test_doctor_says_where_the_kernels_workers_run(tmp_path):
    def line(**env):
        r = _doctor("--no-probe", home=tmp_path, env={"MLX_FLASH_KERNEL_THREADS": "2", **env})
        return next(x for x in r.stdout.splitlines() if x.startswith("quantized kernels "))

    assert "workers pinned, each to a CPU other than the caller's" in line()
    assert "workers not pinned (MLX_FLASH_KERNEL_PIN=0" in line(MLX_FLASH_KERNEL_PIN="0")


def test_doctor_json_and_the_read_probe(tmp_path):
    r = _doctor("--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert "GB/s" in d["read probe"] and isinstance(d["warnings"], list)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not sys.platform.startswith("linux"), reason="needs a tmpfs")
def test_doctor_warns_of_a_memory_file_system(tmp_path):
    shm = f"/dev/shm/mlx_flash_doctor_{os.getpid()}"
    os.makedirs(shm, exist_ok=True)
    try:
        r = _doctor("--no-probe", "--dir", shm, home=tmp_path)
    finally:
        os.rmdir(shm)
    assert r.returncode == 0, r.stderr
    assert "no: reads go through the page cache" in r.stdout and "held in memory" in r.stdout
