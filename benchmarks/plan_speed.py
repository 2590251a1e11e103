"""`longfit plan` of real checkpoints' configs at 128K, cold and warm (#52), and its planned peaks against the slow
planner's.

    PYTHONPATH=src python benchmarks/plan_speed.py --out /tmp/plan_speed [--configs tests/data/checkpoint_configs]
        [--only NAME ...] [--compare NAME ...] [--three-slices NAME ...]

For every `<name>/config.json` folder under --configs: the whole command `longfit plan model=DIR seq_len=131072
lora.enabled=true --gpu h100-80gb --json` in a new process, cold (an empty XDG_CACHE_HOME: interpreter start, imports,
reading the config, tracing the layers, the search for the longest seq_len) and then warm (the same cache), each timed
by the wall clock and by the CPU seconds of the process, with the planned peak. Then, for the --compare configs, the
same plan by the slow planner in a process of its own: the planner as it traced before #52, on fake tensors
(`layer_trace._on_meta`: no operator's outputs remembered, `tracker.MetaResults`), every layer of the model copied
and adapted for each trace (`layer_trace._first_layers`, `_first_layers_adapted`),
every query slice of a capped block and every query block of a sparse indexed layer (`kernels._traced_slices`; the
--three-slices configs keep the three traced slices: `THREE_SLICES`) and every tile of a tiled layer
(`tiled_layers._run_tiles`) run, every sample in one process (`layer_trace._on_two_cores`), with the peak's difference
(the target: within 0.5%).

The runs import a copy of the longfit package this interpreter finds, written under --out/src with its bytecode
compiled, as an install compiles it (`check_speed.compiled_copy`): where PYTHONDONTWRITEBYTECODE is set, every run
would compile the package's sources again.

The targets (#52): cold <= 10 s and warm <= 1 s on a 2-core machine; a shared machine's wall clock is longer than its
CPU seconds. Writes plan_speed.json and plan_speed.md under --out (and the caches, under --out/cache).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from check_speed import compiled_copy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ROOT / "tests" / "data" / "checkpoint_configs"
COMPARED = ["meta-llama--Llama-3.1-8B", "Qwen--Qwen3-8B", "google--gemma-2-9b", "openai--gpt-oss-20b"]
PLAN = ["seq_len=131072", "lora.enabled=true", "--gpu", "h100-80gb", "--json"]

# The slow planner: the same command with #52's shortcuts of the traces undone.
SLOW_PLANNER = """
import copy, sys
from longfit.cli import main
from longfit.memory import tiled_layers
from longfit.models import kernels
from longfit.plan import layer_trace

layer_trace._first_layers = lambda model, count: copy.deepcopy(model)
first_layers_adapted = layer_trace._first_layers_adapted
layer_trace._first_layers_adapted = lambda *args: layer_trace._ADAPTED.clear() or first_layers_adapted(*args)
layer_trace._on_meta = lambda key: False
layer_trace._on_two_cores = lambda measure, samples: measure(samples)
if sys.argv[1] == "every-slice":
    kernels._traced_slices = lambda slices, q: slices
tiled_layers._run_tiles = lambda count, hidden, one_pass: list(range(count))
sys.exit(main(sys.argv[2:]))
"""
# Configs whose slow planner keeps the capped blocks' three traced query slices (`kernels._traced_slices`): every slice
# of Gemma 2 9B's capped layers at the traced lengths is about 600,000 slices of 16 rows, a dozen milliseconds each on
# fake tensors (hours). Its three slices hold what every slice holds at its widths
# (tests/test_plan_speed.py `test_a_capped_block_traced_in_three_slices_holds_what_all_its_slices_hold`).
THREE_SLICES = ["google--gemma-2-9b"]


def run_plan(model: Path, cache: Path, source: Path, slow: bool = False, three_slices: bool = False) -> dict:
    """One `longfit plan` in a new process, longfit imported from `source`: its wall and CPU seconds, the planned peak
    and longest seq_len; `slow`: by the slow planner, `three_slices`: keeping the capped blocks' three traced slices
    (`THREE_SLICES`)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(source)}
    planner = ["-c", SLOW_PLANNER, "three-slices" if three_slices else "every-slice"] if slow else ["-m", "longfit"]
    command = [sys.executable, *planner, "plan", f"model={model}", *PLAN]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if done.returncode != 0:
        return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "error": done.stderr.strip().splitlines()[-1:]}
    plan = json.loads(done.stdout)["plans"][0]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_bytes": plan["peak_bytes"],
            "max_seq_len": plan.get("max_seq_len")}


def gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results and the caches")
    parser.add_argument("--configs", default=str(DEFAULT_CONFIGS), help="folder of <name>/config.json folders")
    parser.add_argument("--only", nargs="*", help="these config folders only")
    parser.add_argument("--compare", nargs="*", default=COMPARED,
                        help="config folders whose peaks are compared with the slow planner's (none: --compare)")
    parser.add_argument("--three-slices", nargs="*", default=THREE_SLICES,
                        help="compared config folders whose slow planner keeps the capped blocks' three traced slices")
    args = parser.parse_args()
    out, configs = Path(args.out), Path(args.configs)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(p.parent.name for p in configs.glob("*/config.json"))
    names = [n for n in names if not args.only or n in args.only]
    source = compiled_copy(out)
    rows = {}
    for name in names:
        cache = out / "cache" / name
        shutil.rmtree(cache, ignore_errors=True)
        cold = run_plan(configs / name, cache, source)
        warm = run_plan(configs / name, cache, source)
        rows[name] = {"cold": cold, "warm": warm}
        print(f"{name:<48} cold {cold['wall_s']:6.1f} s wall {cold['cpu_s']:6.1f} s CPU   warm {warm['wall_s']:5.2f} s "
              f"wall {warm['cpu_s']:5.2f} s CPU   peak {gib(cold.get('peak_bytes'))}"
              + (f"  {cold['error']}" if "error" in cold else ""), flush=True)
    for name in [n for n in args.compare if n in rows and "peak_bytes" in rows[n]["cold"]]:
        cache = out / "cache-slow" / name
        shutil.rmtree(cache, ignore_errors=True)
        slow = run_plan(configs / name, cache, source, slow=True, three_slices=name in args.three_slices)
        slow["slices"] = "three" if name in args.three_slices else "every"
        rows[name]["slow"] = slow
        if "peak_bytes" in slow:
            slow["difference"] = rows[name]["cold"]["peak_bytes"] / slow["peak_bytes"] - 1
        print(f"{name:<48} slow planner ({slow['slices']} slice) {slow['wall_s']:7.1f} s wall "
              f"{slow['cpu_s']:7.1f} s CPU   peak "
              f"{gib(slow.get('peak_bytes'))} (fast {gib(rows[name]['cold']['peak_bytes'])}"
              + (f", {slow['difference']:+.3%})" if "difference" in slow else f") {slow.get('error')}"), flush=True)
    (out / "plan_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| config | cold wall (s) | cold CPU (s) | warm wall (s) | warm CPU (s) | peak | slow planner's peak |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in rows.items():
        cold, warm, slow = row["cold"], row["warm"], row.get("slow", {})
        slices = ", three slices" if slow.get("slices") == "three" else ""
        compared = f"{gib(slow['peak_bytes'])} ({slow['difference']:+.3%}{slices})" if "difference" in slow else "-"
        lines.append(f"| {name} | {cold['wall_s']} | {cold['cpu_s']} | {warm['wall_s']} | {warm['cpu_s']} | "
                     f"{gib(cold.get('peak_bytes')) if 'error' not in cold else cold['error']} | {compared} |")
    (out / "plan_speed.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'plan_speed.json'} and {out / 'plan_speed.md'}")


if __name__ == "__main__":
    main()
