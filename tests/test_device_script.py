"""bench/device.sh, the one device script: every command its header lists is one of its case arms
and back, and an unknown command is refused with status 2, naming where the list is."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "device.sh"


def header_commands(text: str) -> set[str]:
    """Commands named in the header: comment lines '#   name ARGS   what it does'."""
    head = text.split("set -uo pipefail", 1)[0]
    return {m.group(1) for m in re.finditer(r"^#   ([a-z0-9][a-z0-9-]*)(?: |$)", head, re.M)} - {"mkdir", "python3"}


def case_commands(text: str) -> set[str]:
    """The top-level case arms' commands (an arm may name several: ``a|b)``)."""
    body = text.split('case "$cmd" in', 1)[1]
    return {c for m in re.finditer(r"^([a-z0-9][a-z0-9|-]*)\)", body, re.M) for c in m.group(1).split("|")}


def test_header_lists_exactly_the_commands():
    text = SCRIPT.read_text()
    cases = case_commands(text)
    assert {"engine7b", "vllm", "grpo-engines", "cdgrid", "model-piece", "real-eval", "step7b", "step-paper"} <= cases
    assert header_commands(text) == cases


def test_unknown_command_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-command"], cwd=tmp_path, capture_output=True,
                          text=True, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2
    assert "unknown command no-such-command" in proc.stderr and "bench/device.sh" in proc.stderr


def test_out_is_required(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "engine7b"], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode != 0 and "OUT" in proc.stderr


def test_step_commands_call_the_step_bench_with_their_table_settings(tmp_path):
    # a stand-in python3 records each call's arguments (the real run needs the GPU)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$@" >> "$OUT/calls.txt"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    for args in (["step-paper", "nvfp4", "4"], ["step7b"], ["step-model", "Qwen2.5-32B", "nvfp4"]):
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                              env=env, timeout=60)
        assert "bench_step rc=0" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT), "step-model", "Qwen2.5-14B", "nvfp4"], cwd=SCRIPT.parents[1],
                          capture_output=True, text=True, env={**env, "STEP_ARGS": "--max-rows 32 --lora-tiling 8,64,1,reduce"},
                          timeout=60)
    assert "bench_step rc=0" in proc.stdout, proc.stdout + proc.stderr
    calls = [c for c in (out / "calls.txt").read_text().splitlines() if c.startswith("-m bench.bench_step run")]
    assert calls[0] == ("-m bench.bench_step run --models Qwen2.5-7B --formats nvfp4 --lengths paper --prompts 16 "
                        f"--gradient-checkpointing on --mu 4 --steps 2 --budget 400 --limit 540 --out {out}/step-paper-nvfp4-4")
    assert "--formats none nvfp4 --lengths fixed:512 --gradient-checkpointing off on" in calls[1]
    assert "--models Qwen2.5-32B --formats nvfp4 --lengths fixed:512 --gradient-checkpointing on" in calls[2]
    assert calls[1].endswith(f"--out {out}/step7b") and calls[2].endswith(f"--out {out}/step-model-Qwen2.5-32B-nvfp4")
    # STEP_ARGS go to the bench and into the output folder's name: two calls of one command apart (a
    # comma becomes a dash: the device tool returns no file under a name with one)
    assert calls[3].endswith(f"--out {out}/step-model-Qwen2.5-14B-nvfp4-max-rows-32-lora-tiling-8-64-1-reduce "
                             "--max-rows 32 --lora-tiling 8,64,1,reduce")


FAKE_PYTHON = r'''#!/bin/bash
# a stand-in python3: records its arguments and writes the files the real command would
echo "$@" >> "$OUT/calls.txt"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out="$a"; prev="$a"; done
case "$*" in
*bench.bench_step*) mkdir -p "$out"; for f in rows.jsonl step.csv step.md step.png log.txt group0_log.txt \
    group4_log.txt group8_log.txt; do echo x > "$out/$f"; done ;;
*bench.bench_trl_step*) mkdir -p "$out"; for f in rows.jsonl step.md trl-nf4_log.txt trl-bf16_log.txt unsloth_log.txt; do
    echo x > "$out/$f"; done ;;
*bench.bench_memory*) mkdir -p "$out"; for f in memory.json memory.md case_0.5B_nvfp4_log.txt case_0.5B_bf16_log.txt \
    case_7B_nvfp4_log.txt case_7B_bf16_log.txt case_32B_nvfp4_log.txt case_32B_bf16_log.txt; do echo x > "$out/$f"; done ;;
*bench.bench_repro*) mkdir -p "$out"; for f in repro.md repro.json autotune.json; do echo x > "$out/$f"; done ;;
esac
exit 0
'''


def _fake_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    return out, {"OUT": str(out), "PATH": f"{bin_dir}:/usr/bin:/bin"}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != "calls.txt"]


def test_every_bench_command_returns_at_most_eight_files_with_the_logs_archived(tmp_path):
    import tarfile

    for args, loose, archived in (
            (["step7b", "none nvfp4 nf4"], {"step.csv", "step.md", "step.png"},
             {"rows.jsonl", "log.txt", "group0_log.txt", "group4_log.txt", "group8_log.txt", "step7b-none-nvfp4-nf4_log.txt"}),
            (["memory"], {"measured_peaks.json", "memory.json", "memory.md"},
             {"memory_log.txt", "case_0.5B_nvfp4_log.txt", "case_32B_bf16_log.txt"}),
            (["repro"], {"repro.md"}, {"repro_tiny_log.txt", "repro.json", "autotune.json"})):
        out, env = _fake_env(tmp_path / args[0])
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                              env=env, timeout=60)
        files = _files(out)
        assert len(files) <= 8, (args, files, proc.stderr)
        assert loose <= {p.name for p in files}, (args, files)
        tgz = [p for p in files if p.name.endswith(".tgz")]
        assert len(tgz) == 1, files
        with tarfile.open(tgz[0]) as t:
            names = {Path(n).name for n in t.getnames()}
        assert archived <= names, (args, names)


def test_real_model_commands_need_the_checked_model(tmp_path):
    # /tmp/model.sha256.ok is written by model-setup only after the sha256 check; without it (a machine
    # where only some pieces arrived) repro skips the real run and step05b-real refuses
    if Path("/tmp/model.sha256.ok").exists():
        import pytest

        pytest.skip("this machine holds a checked real model")
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "repro"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env=env, timeout=60)
    assert "real 0.5b: skipped" in proc.stdout and "--model /tmp/model.gguf" not in (out / "calls.txt").read_text()
    proc = subprocess.run(["bash", str(SCRIPT), "step05b-real"], cwd=SCRIPT.parents[1], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "run model-setup first" in proc.stderr
    text = SCRIPT.read_text()
    setup = text[text.index("model-setup)"):text.index("real-eval)")]
    assert setup.index("sha256sum -c") < setup.index('"$MODEL_SHA" > /tmp/model.sha256.ok')  # only after the check


def test_the_real_model_switch(tmp_path):
    """REAL_MODEL picks the GGUF whose sha256 model-setup checks and the directory it converts to; a
    marker of the other model does not count, and an unknown name is refused before anything runs."""
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "model-piece", "01"], cwd=SCRIPT.parents[1], capture_output=True,
                          text=True, env={**env, "REAL_MODEL": "7b"}, timeout=60)
    assert proc.returncode == 2 and "REAL_MODEL must be 0.5b or 1.5b; got 7b" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT), "step05b-real"], cwd=SCRIPT.parents[1], capture_output=True,
                          text=True, env={**env, "REAL_MODEL": "1.5b"}, timeout=60)
    assert proc.returncode == 2 and "real 1.5b (/tmp/m15): run model-setup first" in proc.stderr
    text = SCRIPT.read_text()
    sums = dict(re.findall(r"^(0\.5b|1\.5b)\) MODEL_SHA=([0-9a-f]{64}); MODEL_DIR=/tmp/m(?:05|15) ;;$", text, re.M))
    assert sums == {"0.5b": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                    "1.5b": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"}  # fetch-real-model's
    assert "/tmp/m05" not in text[text.index("model-setup)"):]  # every real-* command reads $MODEL_DIR
    # each model's pieces in their own folder (.rm, .rm15), read by model-piece and model-setup alike
    assert 'PIECES=.rm; [ "${REAL_MODEL:-0.5b}" = 1.5b ] && PIECES=.rm15' in text
    pieces = text[text.index("model-piece)"):text.index("real-eval)")]
    assert pieces.count('cat "$PIECES/p$n/part" >> /tmp/model.gguf') == 2 and ".rm/" not in pieces


def test_step_trl_runs_the_trl_bench_at_step7b_shapes_and_archives_its_logs(tmp_path):
    import tarfile

    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "step-trl"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env=env, timeout=60)
    assert "bench_trl_step rc=0" in proc.stdout, proc.stdout + proc.stderr
    call = next(c for c in (out / "calls.txt").read_text().splitlines() if "bench.bench_trl_step" in c)
    tag = "step-trl-trl-nf4-trl-bf16-unsloth-Qwen2.5-7B"
    assert call == ("-m bench.bench_trl_step --stacks trl-nf4 trl-bf16 unsloth --model Qwen2.5-7B --prompts 8 "
                    "--group 8 --new 512 --prompt-len 256 --micro-batch 8 --mu 1 --lora-r 32 "
                    "--gradient-checkpointing on --steps 3 --budget 400 --limit 540 --keep-checkpoint /dev/shm/trl-ckpt "
                    f"--out {out}/{tag}")
    files = _files(out)
    assert len(files) <= 8 and {p.name for p in files} == {"step.md", "logs.tgz"}, files
    with tarfile.open(out / tag / "logs.tgz") as t:
        names = {Path(n).name for n in t.getnames()}
    assert {"rows.jsonl", "trl-nf4_log.txt", "unsloth_log.txt", f"{tag}_log.txt"} <= names
    # stacks, a model directory and extra arguments: a tag of their own, the arguments passed on
    proc = subprocess.run(["bash", str(SCRIPT), "step-trl", "trl-bf16", "/tmp/m05", "--trl-vllm", "colocate"],
                          cwd=SCRIPT.parents[1], capture_output=True, text=True, env=env, timeout=60)
    call = [c for c in (out / "calls.txt").read_text().splitlines() if "bench.bench_trl_step" in c][-1]
    assert "--stacks trl-bf16 --model /tmp/m05 " in call
    assert call.endswith(f"--out {out}/step-trl-trl-bf16-tmp-m05 --trl-vllm colocate"), call


def test_profile_update_routes_and_trim_call_their_benches(tmp_path):
    out, env = _fake_env(tmp_path)
    shape = "--micro-batch 8 --micro-batches 8 --prompt 256 --completion 512 --repeats 3"
    for args, extra in ((["profile-update", "Qwen2.5-0.5B", "none nvfp4"], {"UPDATE_ARGS": shape}),
                        (["profile-update"], {}), (["routes"], {}), (["routes", "Qwen2.5-1.5B", "8 64"], {}),
                        (["trim"], {})):
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                              env={**env, **extra}, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [c for c in (out / "calls.txt").read_text().splitlines() if c.startswith("-m bench.")]
    assert calls[0] == (f"-m bench.bench_dense_cache --model Qwen2.5-0.5B --formats none nvfp4 {shape} "
                        f"--profile {out}/profile-update")
    assert calls[1] == ("-m bench.bench_dense_cache --model Qwen2.5-7B --formats nvfp4 none --micro-batch 8 "
                        "--micro-batches 2 --prompt 256 --completion 512 --checkpointing --repeats 2 "
                        f"--profile {out}/profile-update")
    assert calls[2] == f"-m bench.bench_routes --models Qwen2.5-0.5B Qwen2.5-1.5B --ms 1 8 64 --budget-s 300 --out {out}/routes"
    assert calls[3].startswith("-m bench.bench_routes --models Qwen2.5-1.5B --ms 8 64 ")
    assert calls[4] == (f"-m bench.bench_trim --model Qwen2.5-7B --formats none nvfp4 --checkpointing --repeats 2 "
                        f"--modes padded trimmed sorted packed --out {out}/trim/trim.md")


FAKE_PYSPY = r"""#!/bin/bash
# a stand-in py-spy: records its own arguments, writes a raw sample file, runs the command after --
echo "py-spy $*" >> "$OUT/calls.txt"
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS" >> "$OUT/calls.txt"
o=""; prev=""
while [ "$1" != "--" ]; do [ "$prev" = "-o" ] && o="$1"; prev="$1"; shift; done; shift
echo "main (b.py:1);timed_pass (b.py:2) 5" > "$o"
exec "$@"
"""


def test_pyspy_update_samples_one_process_per_format_and_diffs_them(tmp_path):
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "pyspy-update"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env={**env, "PYSPY": str(tmp_path / "no-py-spy")}, timeout=60)
    assert proc.returncode == 2 and "carry its wheel in .whl/prof" in proc.stdout
    fake = tmp_path / "bin" / "py-spy"
    fake.write_text(FAKE_PYSPY)
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), "pyspy-update", "Qwen2.5-0.5B", "none nvfp4"], cwd=SCRIPT.parents[1],
                          capture_output=True, text=True, env={**env, "PYSPY": str(fake), "PYSPY_RATE": "100"},
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (out / "calls.txt").read_text().splitlines()
    spied = [c for c in calls if c.startswith("py-spy record")]
    assert spied == [f"py-spy record -r 100 --native --format raw -o /tmp/pyspy_{f}.txt -- python3 -m bench.bench_dense_cache "
                     f"--model Qwen2.5-0.5B --formats {f} --modes dense --micro-batch 8 --micro-batches 8 --prompt 256 "
                     f"--completion 512 --repeats 4 --out {out}/pyspy/table_{f}.md" for f in ("none", "nvfp4")]
    assert calls.count("OMP_NUM_THREADS=1") == 2  # one torch thread: py-spy stops each thread per sample
    assert calls[-1] == (f"-m bench.pyspy_diff /tmp/pyspy_none.txt /tmp/pyspy_nvfp4.txt --labels none nvfp4 --rate 100 "
                         f"--out {out}/pyspy/diff.md")
    files = {p.name for p in _files(out)}
    assert {"raw.tgz", "log_none.txt", "log_nvfp4.txt"} <= files and len(files) <= 8


def test_fair_times_the_lut4_kernels_then_the_engine_in_each_format(tmp_path):
    """The fair-baseline call: bench_lut4 per layer, then our engine decoding NVFP4, NF4 and MXFP4 (bitsandbytes'
    variants only where a carry holds it: none in this checkout's fake run unless .vllm carries one)."""
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "fair"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env={**env, "BATCHES": "8 64"}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [c for c in (out / "calls.txt").read_text().splitlines() if c.startswith("-m bench.")]
    carried = (SCRIPT.parents[1] / ".vllm" / "uns" / "slim.tgz").exists() or any(
        (SCRIPT.parents[1] / ".vllm" / "bnb").glob("*.whl"))
    assert calls[0] == f"-m bench.bench_lut4{' --bnb' if carried else ''} --out {out}/fair/lut4"
    assert calls[1] == ("-m bench.bench_rollout --parts rollout --models Qwen2.5-7B --variants engine-nvfp4 engine-nf4 "
                        f"engine-mxfp4{' hf-nf4' if carried else ''} --batches 8 64 --budget 240 --out {out}/fair/engine")
    assert (out / "fair" / "logs.tgz").exists() and len(_files(out)) <= 8


def test_engine_ab_runs_the_update_pass_alone_and_after_our_engine_one_process_each(tmp_path):
    """engine-ab: per format, the dense-cache pass in a process of its own, then the same pass after our
    StaticEngine's rollout (--after-engine, ENGINE_NEW tokens), kept and then dropped (--free-engine); logs
    archived, the tables loose; AB_RUNS picks the runs, a name's parts (after, freed, frozen: --gc-freeze)
    their flags."""
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "engine-ab"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env={**env, "ENGINE_NEW": "64"}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [c for c in (out / "calls.txt").read_text().splitlines() if c.startswith("-m bench.")]
    shape = "--micro-batch 8 --micro-batches 8 --prompt 256 --completion 512 --repeats 4"
    runs = (("alone", ""), ("after-engine", " --after-engine 64"), ("after-freed", " --after-engine 64 --free-engine"))
    assert calls == [f"-m bench.bench_dense_cache --model Qwen2.5-1.5B --formats {f} --modes dense {shape}{extra} "
                     f"--out {out}/engine-ab/{f}-{run}.md" for f in ("none", "nvfp4") for run, extra in runs]
    assert [line.split(" rc=")[0] for line in proc.stdout.splitlines() if " rc=" in line] == \
        [f"{f} {run}" for f in ("none", "nvfp4") for run, _ in runs]
    assert {p.name for p in _files(out)} == {"logs.tgz"}  # the fake wrote no tables; the six logs archived
    out2, env2 = _fake_env(tmp_path / "two")
    proc = subprocess.run(["bash", str(SCRIPT), "engine-ab", "Qwen2.5-0.5B", "nvfp4"], cwd=SCRIPT.parents[1],
                          capture_output=True, text=True, env={**env2, "AB_RUNS": "after-freed-frozen"}, timeout=60)
    calls = [c for c in (out2 / "calls.txt").read_text().splitlines() if c.startswith("-m bench.")]
    assert proc.returncode == 0 and calls == [
        f"-m bench.bench_dense_cache --model Qwen2.5-0.5B --formats nvfp4 --modes dense {shape} --after-engine 512 "
        f"--free-engine --gc-freeze --out {out2}/engine-ab/nvfp4-after-freed-frozen.md"], proc.stdout + proc.stderr


def test_lut4_sweep_calls_the_sweep_and_keeps_its_log(tmp_path):
    out, env = _fake_env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "lut4-sweep"], cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0 and "sweep rc=0" in proc.stdout, proc.stdout + proc.stderr
    calls = [c for c in (out / "calls.txt").read_text().splitlines() if c.startswith("-m bench.")]
    assert calls == [f"-m bench.bench_lut4_sweep --out {out}/lut4-sweep"]
    assert (out / "lut4-sweep" / "sweep_log.txt").exists()
