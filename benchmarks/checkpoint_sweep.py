"""The published config.json of popular checkpoints (tests/data/checkpoint_configs) as a user meets them (#52):
`longfit check`, `longfit plan` at 32K and 128K tokens, and one `longfit train` step of a tiny-width copy.

    PYTHONPATH=src nice -n 10 python benchmarks/checkpoint_sweep.py --out DIR [--only NAME ...]
        [--parts check train plan] [--regimes fp32 gpu] [--again] [--timeout S] [--plan-timeout S]

For each folder (a checkpoint's config.json alone, no weights):
- check: what `longfit check model=FOLDER seq_len=512` answers, in the fp32 regime and the GPU regime, run as the
  default-config sweep runs it (`longfit.check.sweep.check_regime`, in its worker process: torch and transformers
  imported once, a fresh worker after a crash or a timeout). "cannot shrink" is a failure of the sweep (#52).
- train: the check's shrunken copy of the checkpoint's architecture (one decoder layer of each kind, tiny widths,
  the checkpoint's RoPE scaling, windows, softcaps, multipliers, partial rotary, NoPE layers and experts;
  `longfit.check.shrink.shrink_config`) written by transformers (`save_pretrained`, with longfit's byte tokenizer),
  then `longfit train` on it for one step of TRAIN_SEQ_LEN tokens of the synthetic task, as a user runs it (its
  check gate and preflight included): the loss of that step, or the error line it ends with.
- plan: `longfit plan model=FOLDER seq_len=N lora.enabled=true --gpu h100-80gb --json` for N in PLAN_LENGTHS: the
  planned peak against the GPU's 80 GB, and the longest seq_len that fits. A plan that runs past --plan-timeout
  is recorded as timed out, with its time.
Every command runs with one CPU thread, one at a time.

Writes DIR/checkpoint_sweep.json ({"transformers", "torch", "rows": [{"name", "model_type", "architecture",
"fp32", "gpu", "train", "plan_32k", "plan_128k"}]}: the families page lists it, docs/gen/docgen.py) and
DIR/checkpoint_sweep.md. Resumable: a rerun keeps DIR's rows and runs only the parts a row lacks (--again: the
asked parts again, e.g. `--parts plan --again` once planning is faster); the tiny copies and training runs go
under DIR/copies and DIR/runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from longfit.check.sweep import REGIMES, Worker, check_regime, versions  # noqa: E402

CONFIGS = ROOT / "tests" / "data" / "checkpoint_configs"
PARTS = ("check", "train", "plan")
TRAIN_SEQ_LEN = 256  # four of the check's rows: the copy's windows (at most the check's 21 tokens) slide within it
PLAN_LENGTHS = {"plan_32k": 32768, "plan_128k": 131072}
PLAN_ARGS = ["lora.enabled=true", "--gpu", "h100-80gb", "--json"]
TIMEOUT_S = 600
PLAN_TIMEOUT_S = 600
GIB = 2**30


def checkpoint_names(configs: Path = CONFIGS) -> list[str]:
    """The folders holding a config.json, by name (`<hf-org>--<name>`)."""
    return sorted(path.parent.name for path in configs.glob("*/config.json"))


def _env() -> dict:
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("[")]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------------- the worker


def write_copy(directory: str, into: Path) -> dict:
    """The check's shrunken copy of `directory`'s language model, written by transformers into `into` with longfit's
    byte tokenizer: its layer kinds, or why it cannot be written."""
    import torch

    from longfit.check.parity import ROW
    from longfit.check.shrink import causal_lm, first_line, shrink_config
    from longfit.config import ConfigError
    from longfit.data.tokenizer import byte_tokenizer
    from longfit.models.loading import resolve_model_config

    try:
        shrunk = shrink_config(resolve_model_config(directory), ROW)
        torch.manual_seed(0)
        causal_lm(shrunk.config).save_pretrained(into)
        byte_tokenizer().save_pretrained(into)
    except ConfigError as error:
        return {"verdict": "refused", "detail": str(error).replace(directory, "DIR")[:400]}
    except Exception as error:  # noqa: BLE001 -- the copy cannot be written: the train part's answer
        return {"verdict": "cannot shrink", "detail": first_line(error).replace(directory, "DIR")[:400]}
    kinds = ", ".join(kind.name for kind in shrunk.kinds)
    return {"verdict": "written", "detail": f"{len(shrunk.kinds)} of {shrunk.full_layers} layers ({kinds})"[:400]}


def _worker(copies: Path, parts: list[str]) -> None:
    """For each `NAME<TAB>DIR` line on stdin: each check regime of `parts`, then the copy; one JSON line per part,
    then {"done": NAME}."""
    import torch

    torch.set_num_threads(1)
    for line in sys.stdin:
        name, directory = line.rstrip("\n").split("\t")
        results = {}
        for part in parts:
            results[part] = write_copy(directory, copies / name) if part == "copy" else check_regime(directory, part)
            print(json.dumps({part: results[part]}), flush=True)
        print(json.dumps({**results, "done": name}), flush=True)


# ---------------------------------------------------------------------------------------------------- the commands


def _timed(argv: list[str], timeout: int) -> tuple[subprocess.CompletedProcess | None, float]:
    """The command's outcome (None: it ran past `timeout`) and its wall seconds."""
    start = time.monotonic()
    try:
        done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, timeout
    return done, round(time.monotonic() - start, 1)


def train_step(copy: Path, run: Path, timeout: int) -> dict:
    """One `longfit train` step of the tiny copy: its loss, or the line the command ends with."""
    argv = [sys.executable, "-m", "longfit", "train", f"model={copy}", f"seq_len={TRAIN_SEQ_LEN}", "train.steps=1",
            "train.device=cpu", f"output_dir={run}", "eval.retrieval=false", "train.export=false"]
    done, seconds = _timed(argv, timeout)
    if done is None:
        return {"verdict": "timed out", "detail": f"no step within {timeout} s", "seconds": timeout}
    metrics = run / "metrics.jsonl"
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line] \
        if metrics.is_file() else []
    if done.returncode == 0 and losses:
        return {"verdict": "trained", "loss": losses[-1], "detail": f"loss {losses[-1]:.4f}", "seconds": seconds}
    return {"verdict": "fails", "detail": _last_line(done.stderr + done.stdout).replace(str(copy), "COPY")[:400],
            "seconds": seconds}


def plan(directory: Path, seq_len: int, timeout: int) -> dict:
    """`longfit plan` of the checkpoint at `seq_len` (PLAN_ARGS): the planned peak and whether it fits one GPU, the
    longest seq_len that fits, the command's time; or its error line, or the time it ran past."""
    argv = [sys.executable, "-m", "longfit", "plan", f"model={directory}", f"seq_len={seq_len}", *PLAN_ARGS]
    done, seconds = _timed(argv, timeout)
    if done is None:
        return {"verdict": "timed out", "detail": f"no plan within {timeout} s", "seconds": timeout}
    try:
        entry = json.loads(done.stdout)["plans"][0]
    except (ValueError, KeyError, IndexError):
        line = _last_line(done.stderr + done.stdout).replace(str(directory), "DIR")
        return {"verdict": "fails", "detail": line[:400], "seconds": seconds}
    fits = entry["capacity_bytes"] is not None and entry["peak_bytes"] <= entry["capacity_bytes"]
    return {"verdict": "fits" if fits else "does not fit", "peak_gib": round(entry["peak_bytes"] / GIB, 2),
            "capacity_gib": round(entry["capacity_bytes"] / GIB, 2) if entry["capacity_bytes"] else None,
            "max_seq_len": entry.get("max_seq_len"), "seconds": seconds, "detail": ""}


# ---------------------------------------------------------------------------------------------------- the results


def _described(directory: Path) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    return {"model_type": config.model_type, "architecture": (config.architectures or [None])[0]}


def _cell(outcome: dict | None) -> str:
    if not outcome:
        return "not run"
    if outcome["verdict"] in ("fits", "does not fit"):
        longest = outcome.get("max_seq_len")
        text = (f"{outcome['verdict']}: {outcome['peak_gib']:.1f} of {outcome['capacity_gib']:.1f} GiB; longest "
                f"{longest // 1024 if longest else 0}K; {outcome['seconds']:.0f} s")
        return text
    detail = outcome.get("detail", "").replace("|", "\\|")
    seconds = f" ({outcome['seconds']:.0f} s)" if outcome.get("seconds") and outcome["verdict"] != "timed out" else ""
    return outcome["verdict"] + (f": {detail}" if detail else "") + seconds


def markdown(results: dict) -> str:
    rows = results["rows"]
    exact = {regime: sum(row.get(regime, {}).get("verdict") == "exact" for row in rows) for regime in REGIMES}
    trained = sum(row.get("train", {}).get("verdict") == "trained" for row in rows)
    planned = {key: sum(row.get(key, {}).get("verdict") in ("fits", "does not fit") for row in rows)
               for key in PLAN_LENGTHS}
    lines = ["# The published configs of popular checkpoints: check, plan, train",
             "",
             f"transformers {results['transformers']}, torch {results['torch']}: {len(rows)} checkpoints' config.json "
             "(tests/data/checkpoint_configs, sources in its README). `longfit check model=DIR seq_len=512` in fp32 "
             f"and in the GPU regime (the command's default): {exact['fp32']} exact in fp32, {exact['gpu']} in the GPU "
             f"regime; one `longfit train` step ({TRAIN_SEQ_LEN} tokens, synthetic task) of the check's tiny-width "
             f"copy: {trained} trained; `longfit plan model=DIR seq_len=N {' '.join(PLAN_ARGS[:-1])}`: "
             f"{planned['plan_32k']} answered at 32K, {planned['plan_128k']} at 128K (each with a time limit; this "
             "shared 2-core machine). Rerun: `PYTHONPATH=src nice -n 10 python benchmarks/checkpoint_sweep.py --out "
             "benchmarks/results`.",
             "",
             "| checkpoint | model_type | check fp32 | check GPU regime | train step | plan 32K | plan 128K |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in sorted(rows, key=lambda r: r["name"].lower()):
        lines.append(f"| {row['name']} | {row['model_type']} | {_cell(row.get('fp32'))} | {_cell(row.get('gpu'))} | "
                     f"{_cell(row.get('train'))} | {_cell(row.get('plan_32k'))} | {_cell(row.get('plan_128k'))} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["rows"].sort(key=lambda r: r["name"].lower())
    (out / "checkpoint_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "checkpoint_sweep.md").write_text(markdown(results))


def _keys(parts: list[str], regimes: list[str]) -> list[str]:
    return [*(regimes if "check" in parts else []), *(["train"] if "train" in parts else []),
            *(PLAN_LENGTHS if "plan" in parts else [])]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for checkpoint_sweep.json / .md, copies, runs")
    parser.add_argument("--only", nargs="*", help="these folders of tests/data/checkpoint_configs (default: all)")
    parser.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    parser.add_argument("--regimes", nargs="*", choices=list(REGIMES), default=list(REGIMES),
                        help="the check's regimes (gpu: the command's default)")
    parser.add_argument("--again", action="store_true", help="run the asked parts of rows that have them")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per check regime, copy and train step")
    parser.add_argument("--plan-timeout", type=int, default=PLAN_TIMEOUT_S, help="seconds per `longfit plan`")
    args = parser.parse_args(argv)
    existing = args.out / "checkpoint_sweep.json"
    results = {**versions(), "rows": json.loads(existing.read_text())["rows"] if existing.exists() else []}
    rows = {row["name"]: row for row in results["rows"]}
    copies = (args.out / "copies").resolve()
    workers: dict[tuple, Worker] = {}  # by the parts a worker answers: a row lacking some asks only for those
    try:
        for name in args.only or checkpoint_names():
            directory = CONFIGS / name
            if name not in rows:
                rows[name] = {"name": name, **_described(directory)}
                results["rows"].append(rows[name])
            row = rows[name]
            wanted = [key for key in _keys(args.parts, args.regimes) if args.again or key not in row]
            asked = tuple([*(key for key in REGIMES if key in wanted), *(["copy"] if "train" in wanted else [])])
            if asked:
                if asked not in workers:
                    workers[asked] = Worker(list(asked), args.timeout, [sys.executable, str(Path(__file__).resolve()),
                                                                       "--worker", str(copies), *asked])
                answers = workers[asked].check(name, str(directory))
                row.update({key: answers[key] for key in asked if key in REGIMES})
                if "train" in wanted:
                    copy = answers["copy"]
                    row["train"] = (train_step(copies / name, (args.out / "runs" / name).resolve(), args.timeout)
                                    if copy["verdict"] == "written" else copy)
            for key, seq_len in PLAN_LENGTHS.items():
                if key in wanted:
                    row[key] = plan(directory, seq_len, args.plan_timeout)
            print(f"{name}: " + "; ".join(f"{key} {row[key]['verdict']} {row[key].get('detail', '')[:120]}"
                                         for key in _keys(args.parts, args.regimes) if key in row), flush=True)
            write(results, args.out)
    finally:
        for worker in workers.values():
            worker.close()


if __name__ == "__main__":
    main()
