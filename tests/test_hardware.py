"""What the machine offers: the CPU budget from affinity and cgroup quotas, native bf16 as torch and
oneDNN see it (holds honoured), and what ``auto`` resolves to."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from pipelines import hardware
from pipelines.errors import ConfigError

CPU = torch.device("cpu")
HOLD_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    (tmp_path / "proc").write_text(proc_line + "\n")
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "sys", tmp_path / "proc"


def test_cgroup_v2_quota_of_the_process_and_its_parents(tmp_path):
    # docker --cpus=1.5 on the container's cgroup, a looser quota above it: the smallest applies
    root, proc = _cgroup(tmp_path, "0::/docker/abc", {"docker/abc/cpu.max": "150000 100000",
                                                     "docker/cpu.max": "400000 100000", "cpu.max": "max 100000"})
    assert hardware.cpu_quota(root, proc) == 1.5
    (tmp_path / "none").mkdir()
    root, proc = _cgroup(tmp_path / "none", "0::/", {"cpu.max": "max 100000"})
    assert hardware.cpu_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path):
    root, proc = _cgroup(tmp_path, "4:cpu,cpuacct:/job", {"cpu,cpuacct/job/cpu.cfs_quota_us": "200000",
                                                          "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
                                                          "cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                                          "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert hardware.cpu_quota(root, proc) == 2.0
    assert hardware.cpu_quota(tmp_path / "missing", tmp_path / "missing-proc") is None


def test_the_cpu_budget_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(hardware, "cpu_quota", lambda: 2.0)  # docker --cpus=2 on a 64-core host
    assert hardware.cpu_budget() == 2
    monkeypatch.setattr(hardware, "cpu_quota", lambda: 0.5)
    assert hardware.cpu_budget() == 1  # at least one
    monkeypatch.setattr(hardware, "cpu_quota", lambda: None)
    assert hardware.cpu_budget() == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})  # taskset -c 3,5
    assert hardware.cpu_budget() == 2


def test_the_training_process_threads_come_from_the_budget(monkeypatch):
    from pipelines import distributed

    monkeypatch.setattr(hardware, "cpu_budget", lambda: 6)
    monkeypatch.delenv(hardware.THREADS_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        assert distributed.init_from_env() == CPU and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_pipelines_threads_sets_each_process_threads_and_a_bad_value_is_one_line(monkeypatch):
    """For runs that share the cores with others the budget cannot see (a `dvc queue start -j 2` sweep)."""
    from pipelines import distributed

    monkeypatch.setattr(hardware, "cpu_budget", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv(hardware.THREADS_ENV, "1")
        assert distributed.init_from_env() == CPU and torch.get_num_threads() == 1
        monkeypatch.setenv(hardware.THREADS_ENV, " ")  # blank: as if unset
        assert hardware.threads_per_process(2) == 3
        for bad in ("0", "two", "-1", "1.5"):
            monkeypatch.setenv(hardware.THREADS_ENV, bad)
            with pytest.raises(ConfigError) as err:
                distributed.init_from_env()
            assert str(err.value) == (f"PIPELINES_THREADS={bad!r} in the environment: expected a whole number of "
                                      "threads, at least 1")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flags, aten, cap, expected", [
    ({"avx512_bf16"}, "AVX512", None, "avx512_core_bf16"),  # Zen 4, Cooper Lake
    ({"avx512_bf16"}, "AVX512", "AVX512_CORE_BF16", "avx512_core_bf16"),
    ({"avx512_bf16"}, "AVX512", "AVX2", None),  # held to AVX2
    ({"avx512_bf16"}, "AVX2", None, None),  # ATen held to AVX2
    ({"avx512_bf16"}, "AVX512", "AVX512_CORE_VNNI", None),  # held to Cascade Lake's ISA
    (set(), "AVX512", None, None),  # Skylake-SP, Cascade Lake, Ice Lake: AVX-512 without BF16
    (set(), "AVX2", None, None),  # an AVX2 machine
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "AVX512", None, "avx512_core_amx"),  # Sapphire Rapids
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "AVX512", "AVX512_CORE_BF16", "avx512_core_bf16"),
    ({"avx_ne_convert", "avx_vnni"}, "AVX2", None, "avx2_vnni_2"),  # AVX2_VNNI_2 (Sierra Forest, Arrow Lake)
    ({"avx_ne_convert", "avx_vnni"}, "AVX2", "AVX2_VNNI", None),
])
def test_native_bf16_as_torch_and_onednn_see_it(monkeypatch, flags, aten, cap, expected):
    names = ("avx512_bf16", "amx_bf16", "amx_tile", "avx_ne_convert", "avx_vnni")
    monkeypatch.setattr(torch.cpu, "get_capabilities",
                        lambda: {"architecture": "x86_64", **{f: f in flags for f in names}})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert hardware.native_bf16_cpu() == expected
    resolved = hardware.resolve("auto", "auto", CPU)
    # channels_last: with bf16, and with fp32 on AVX-512 (faster there), not with fp32 on AVX2 (slower)
    assert (resolved.precision, resolved.channels_last) == (("bf16", True) if expected else ("fp32", aten == "AVX512"))


def test_bf16_is_not_native_off_x86(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "aarch64"})
    assert hardware.native_bf16_cpu() is None


def test_explicit_values_are_kept_and_emulated_bf16_is_named(monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: None)
    explicit = hardware.resolve("bf16", True, CPU)
    assert (explicit.precision, explicit.channels_last) == ("bf16", True)
    assert explicit.warning.startswith("model.precision bf16: bf16 is emulated here (no native bf16 on this CPU")
    assert "18x slower than fp32 on an AVX2 CPU, 2.1x on AVX-512 without BF16" in explicit.warning
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert hardware.resolve("fp32", "auto", CPU) == hardware.Compute(
        "fp32", False, "set in model.precision; " + hardware.bf16_support(CPU)[1])
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: "avx512_core_bf16")
    assert hardware.resolve("bf16", "auto", CPU).warning is None
    assert hardware.resolve("fp16", "auto", CPU).channels_last  # channels_last with reduced precision


def _kernels(env: dict) -> tuple[str, str, set[str]]:
    """ATen's level, oneDNN's ISA and the oneDNN convolution kernels of an fp32 and a bf16 convolution,
    under ``env``, in a fresh process."""
    code = ("import torch\n"
            "x, w = torch.randn(2, 64, 56, 56), torch.randn(64, 64, 3, 3)\n"
            "torch.nn.functional.conv2d(x, w)\n"
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    torch.nn.functional.conv2d(x, w)\n"
            "print('ATEN', torch.backends.cpu.get_cpu_capability(), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "ONEDNN_VERBOSE": "1"},
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    aten = next(line.split()[1] for line in lines if line.startswith("ATEN"))
    isa = next(line.split("isa:")[1] for line in lines if ",info,cpu,isa:" in line)
    kernels = {line.split(",")[6] for line in lines if ",primitive,exec,cpu,convolution," in line}
    return aten, isa, kernels


def test_a_hold_to_avx2_changes_the_kernels_torch_and_onednn_run():
    """The hold that measures the AVX2 class on a faster machine is real: ATen dispatches its AVX2
    kernels and oneDNN runs AVX2 convolutions (unheld on an AVX512-BF16 machine: avx512_core, and bf16
    convolutions on avx512_core_bf16; held, bf16 convolutions do not reach oneDNN at all)."""
    aten, isa, kernels = _kernels(HOLD_AVX2)
    assert aten == "AVX2" and isa == "Intel AVX2"
    assert kernels and all(k.endswith(":avx2") for k in kernels)
    if hardware.native_bf16_cpu() == "avx512_core_bf16":
        aten, isa, kernels = _kernels({k: "" for k in HOLD_AVX2})
        assert aten == "AVX512" and "bfloat16" in isa
        assert {"jit:avx512_core", "jit_bf16:avx512_core_bf16"} <= kernels


@pytest.mark.slow
def test_the_tiny_pipeline_held_to_avx2_resolves_auto_to_fp32(tmp_path):
    """The fresh-clone benchmark of the tiny configuration on this machine held to AVX2, as a CPU class is
    measured (``benchmarks/fresh_clone.py``): the doctor and train say that auto chose fp32 and why (train in
    its first line), both MLflow runs record it, the model stores it, evaluate computes as it was trained,
    and the benchmark times the stages against the doctor's prediction and then the tests."""
    import mlflow

    from benchmarks import fresh_clone

    from .test_pipeline import TINY_ONE_PROCESS, _env

    tests = "python -m pytest -q -p no:cacheprovider tests/test_solver.py"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fresh_clone", "--overrides", " ".join(TINY_ONE_PROCESS),
                           "--tests", tests, "--workdir", str(tmp_path), "--json"], cwd=fresh_clone.REPO,
                          env={**_env(), **HOLD_AVX2}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    chose = ("precision fp32, channels_last off: auto: no native bf16 on this CPU (ATen at AVX2, oneDNN held to "
             "AVX2; no AVX512_BF16, AMX or AVX2_VNNI_2 as oneDNN counts them)")
    assert figures["pipeline"]["first_line"] == chose  # the train stage's first line
    assert figures["machine"]["isa"].startswith("AVX2") and figures["compute"]["precision"] == "fp32"  # the doctor's too
    assert list(figures["pipeline"]["stages"]) == ["prepare", "cache", "train", "evaluate", "export"]
    assert figures["predicted_s"]["total"] > 0 and 0 <= figures["pipeline"]["AP"] <= 1
    assert figures["tests"]["exit_code"] == 0 and figures["tests"]["counts"]["passed"] >= 1
    assert "| `dvc repro`, all stages (wall) |" in fresh_clone.table(figures)

    repo, output = tmp_path / "repo", (tmp_path / "repro.log").read_text()
    model = hashlib.sha256((repo / "outputs" / "train" / "model_final.pth").read_bytes()).hexdigest()
    assert figures["pipeline"]["model_sha256"] == model and f"`{model}`" in fresh_clone.table(figures)
    assert "precision fp32, channels_last off: as the model was trained (stored in outputs/train/model_final.pth)" \
        in output[output.index("Running stage 'evaluate'"):]
    assert torch.load(repo / "outputs" / "train" / "model_final.pth", weights_only=True)["precision"] == "fp32"
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("detection").experiment_id])
    assert len(runs) == 2 and {r.data.params["compute.precision"] for r in runs} == {"fp32"}
    assert {r.data.params["model.precision"] for r in runs} == {"auto"}
