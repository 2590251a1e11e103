"""How long `longfit check` takes, cold (an empty verdict cache) and warm (the same command again), per model (#52).

    PYTHONPATH=src nice -n 10 python benchmarks/check_speed.py --out /tmp/check_speed [--models DIR ...] \
        [--items seq_len=131072 lora.enabled=true parallel.cp=2]

Each run is the whole command in a fresh interpreter (`python -m longfit check`), timed in wall and CPU seconds
(its process and the ranks it starts); the load average beside each, as the machine may be shared. The floor
beside them: a fresh interpreter importing torch and transformers' Llama model, which any cold check pays before
its own work. Writes check_speed.json and check_speed.md under --out, the verdict cache under --out/cache.

The runs import a copy of the longfit package this interpreter finds, written under --out/src with its bytecode
compiled, as an install compiles it: where PYTHONDONTWRITEBYTECODE is set, every run would compile the package's
sources again, CPU seconds no installed longfit spends. The verdict cache is emptied first: the first run is cold.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "checkpoint_configs"
FLOOR = "import torch, transformers; from transformers import LlamaForCausalLM"


def timed(command: list[str], env: dict[str, str]) -> dict:
    """Wall and CPU seconds (user + system, its children included) of `command`, its exit status and last line
    printed (stdout's, else stderr's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()  # the verdict, not a library's warning after it
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "status": done.returncode,
            "last_line": lines[-1][:200] if lines else "", "load": os.getloadavg()[0]}


def compiled_copy(out: Path) -> Path:
    """The folder holding a copy of the longfit package this interpreter imports, its bytecode compiled."""
    source = Path(importlib.util.find_spec("longfit").origin).parent
    root = out / "src"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root / "longfit", ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(root, quiet=1)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the results and the verdict cache")
    parser.add_argument("--models", nargs="*", default=None, help="model directories (default: every config of "
                        "tests/data/checkpoint_configs)")
    parser.add_argument("--items", nargs="*", default=["seq_len=131072", "lora.enabled=true"],
                        help="config overrides of every check")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = args.models or sorted(str(p) for p in CONFIGS.iterdir() if (p / "config.json").is_file())
    path = os.pathsep.join(filter(None, [str(compiled_copy(out)), os.environ.get("PYTHONPATH")]))
    shutil.rmtree(out / "cache", ignore_errors=True)
    env = dict(os.environ, XDG_CACHE_HOME=str(out / "cache"), PYTHONPATH=path)
    floor = timed([sys.executable, "-c", FLOOR], env)
    print(f"floor (torch and transformers' Llama imported): {floor['wall_s']} s wall {floor['cpu_s']} s CPU",
          flush=True)
    rows = []
    for model in models:
        command = [sys.executable, "-m", "longfit", "check", f"model={model}", *args.items]
        cold, warm = timed(command, env), timed(command, env)
        rows.append({"model": Path(model).name, "cold": cold, "warm": warm})
        print(f"{Path(model).name}: cold {cold['wall_s']} s wall {cold['cpu_s']} s CPU (load {cold['load']:.1f}), "
              f"warm {warm['wall_s']} s wall {warm['cpu_s']} s CPU; {cold['last_line'][:80]}", flush=True)
    (out / "check_speed.json").write_text(json.dumps({"items": args.items, "floor": floor, "rows": rows}, indent=1))
    table = ["| model | cold wall s | cold CPU s | load | warm wall s | warm CPU s | verdict |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['model']} | {r['cold']['wall_s']} | {r['cold']['cpu_s']} | {r['cold']['load']:.1f} | "
              f"{r['warm']['wall_s']} | {r['warm']['cpu_s']} | {r['cold']['last_line'][:60]} |" for r in rows]
    (out / "check_speed.md").write_text(f"`longfit check ... {' '.join(args.items)}`; floor {floor['cpu_s']} CPU s "
                                        f"(`{FLOOR}`)\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
