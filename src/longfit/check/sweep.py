"""The sweep: `longfit check` on the default config of every decoder-only causal LM type transformers defines.

    PYTHONPATH=src nice -n 10 python benchmarks/check_sweep.py --out benchmarks/results [--types gpt2 llama] [--resume]

For each type of transformers' causal LM mapping whose default config is a decoder alone (`decoder_only_types`):
`AutoConfig.for_model(type).save_pretrained(dir)`, then what `longfit check model=dir seq_len=512` runs, in both
regimes: fp32 (`train.device=cpu`) and the GPU regime (the default: bf16 autocast and the CUDA kernel choices, as
the check emulates them on the CPU). A type's two checks run in one subprocess (its imports paid once) with a
timeout per regime. Each outcome is one VERDICTS entry: exact; a `longfit: error:` line (a ConfigError) read as
refused, not exact, a traceback inside longfit's step, cannot shrink or transformers fails (`classify`); any
other exception, or no verdict in time, is a crash. One type runs at a time: the check is CPU-bound.

Writes OUT/check_sweep.json ({"transformers", "torch", "rows": [{"model_type", "architecture", "fp32": {"verdict",
"detail"}, "gpu": {...}}]}: the docs' families table is generated from it) and OUT/check_sweep.md (the counts per
verdict and regime, then one row per type). A new transformers release: rerun it and compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from longfit.check.parity import NOT_EXACT, STEP_FAILS
from longfit.check.shrink import first_line

SEQ_LEN = 512
TIMEOUT_S = 600
REGIMES = {"fp32": ["train.device=cpu"], "gpu": []}
VERDICTS = ("exact", "refused", "not exact", "traceback", "crash", "cannot shrink", "transformers fails")
SHRINK_FAILS = "cannot build a shrunken copy"
MODEL_FAILS = ("transformers' eager reference", "transformers cannot build")


def decoder_only_types() -> list[str]:
    """Model types of transformers' causal LM mapping whose default config is a decoder alone: not an encoder-decoder,
    and not an encoder that can be made a decoder (BERT-style configs, with `is_decoder` and `add_cross_attention`)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 -- a default config transformers cannot build is the sweep's row to report
            types.append(model_type)
            continue
        if getattr(config, "is_encoder_decoder", False):
            continue
        try:
            text = config.get_text_config()
        except ValueError:  # several text configs (MusicGen's text encoder and decoder): not a decoder alone
            continue
        if getattr(text, "is_encoder_decoder", False):
            continue
        if {"is_decoder", "add_cross_attention"} <= set(vars(type(text)).get("__annotations__", {})):
            continue
        types.append(model_type)
    return types


def classify(message: str) -> str:
    """The verdict a `longfit: error:` line of the check stands for."""
    if SHRINK_FAILS in message:
        return "cannot shrink"
    if any(phrase in message for phrase in MODEL_FAILS):
        return "transformers fails"
    if STEP_FAILS in message:
        return "traceback"
    if NOT_EXACT in message:
        return "not exact"
    return "refused"


def check_regime(directory: str, regime: str) -> dict:
    """`longfit check model=directory seq_len=SEQ_LEN` in `regime`, as the command runs it (one CPU thread): the
    verdict, and its one line (a ConfigError: what the command prints after `longfit: error:`) or the last line of
    an exception's traceback (the command would crash)."""
    import traceback

    import torch

    from longfit.check.parity import check_run
    from longfit.config import ConfigError, load_config

    torch.set_num_threads(1)
    try:
        cfg = load_config(None, [f"model={directory}", f"seq_len={SEQ_LEN}", *REGIMES[regime]])
        check_run(cfg, "cpu" if cfg.train.device == "cpu" else "cuda").raise_if_not_exact()
    except ConfigError as error:
        message = str(error).replace(directory, "DIR")
        return {"verdict": classify(message), "detail": message[:400]}
    except Exception:  # noqa: BLE001 -- the command would end in a traceback: a crash, its last line the detail
        lines = [line for line in traceback.format_exc().splitlines() if line.strip()]
        return {"verdict": "crash", "detail": lines[-1].replace(directory, "DIR")[:400]}
    return {"verdict": "exact", "detail": ""}


def _env() -> dict:
    src = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))


def _worker(regimes: list[str]) -> None:
    """The worker process: for each `TYPE<TAB>DIR` line on stdin, the default config written, then each regime
    checked; one JSON line per result, then {"done": TYPE}."""
    from transformers import AutoConfig

    for line in sys.stdin:
        model_type, directory = line.rstrip("\n").split("\t")
        try:
            AutoConfig.for_model(model_type).save_pretrained(directory)
        except Exception as error:  # noqa: BLE001 -- transformers' own default config does not build
            detail = f"transformers rejects its own default config of this type: {first_line(error)}"[:400]
            results = {regime: {"verdict": "transformers fails", "detail": detail} for regime in regimes}
        else:
            results = {}
            for regime in regimes:
                results[regime] = check_regime(directory, regime)
                print(json.dumps({regime: results[regime]}), flush=True)
        print(json.dumps({**results, "done": model_type}), flush=True)


class Worker:
    """One worker process that checks type after type (torch and transformers imported once); a type that crashes
    it or runs past its time gets a fresh one.

    `argv` starts another worker that speaks the same lines (a `KEY<TAB>DIR` line in, one JSON line per part out,
    then {"done": KEY}): benchmarks/checkpoint_sweep.py's, whose parts are the regimes and the copy it writes."""

    def __init__(self, regimes: list[str], timeout: int, argv: list[str] | None = None):
        self.regimes, self.timeout, self.process = regimes, timeout, None
        self.argv = argv or [sys.executable, "-m", "longfit.check.sweep", "--worker", *regimes]
        self.stderr = tempfile.TemporaryFile(mode="w+")

    def _start(self) -> None:
        import queue
        import threading

        self.process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True, env=_env(), bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        stdout, lines = self.process.stdout, self.lines

        def read() -> None:  # a thread: a pipe's buffered lines are not seen by select()
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def _last_error_line(self, since: int) -> str:
        self.stderr.seek(since)
        lines = [line for line in self.stderr.read().splitlines() if line.strip() and not line.startswith("[")]
        self.stderr.seek(0, os.SEEK_END)
        return lines[-1][:400] if lines else "the worker process ended"

    def check(self, model_type: str, directory: str) -> dict:
        import queue
        import time

        if self.process is None:
            self._start()
        since = self.stderr.seek(0, os.SEEK_END)
        self.process.stdin.write(f"{model_type}\t{directory}\n")
        self.process.stdin.flush()
        results: dict = {}
        deadline = time.monotonic() + self.timeout * len(self.regimes)
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._stop()
                ended = f"no verdict within {self.timeout} s"
                break
            if line is None:  # the worker died (a segfault, an abort): what it printed last is the detail
                self.process.wait()
                ended = self._last_error_line(since)
                self.process = None
                break
            if line.startswith("{"):
                result = json.loads(line)
                if result.pop("done", None) is not None:
                    return result
                results.update(result)
        return {**{regime: {"verdict": "crash", "detail": ended} for regime in self.regimes}, **results}

    def close(self) -> None:
        self._stop()
        self.stderr.close()


def sweep_type(worker: Worker, model_type: str) -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with tempfile.TemporaryDirectory(prefix=f"longfit-sweep-{model_type}-") as directory:
        return {"model_type": model_type, "architecture": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type),
                **worker.check(model_type, directory)}


def versions() -> dict:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def markdown(results: dict) -> str:
    regimes = list(REGIMES)
    counts = {r: {v: sum(1 for row in results["rows"] if row.get(r, {}).get("verdict") == v) for v in VERDICTS}
              for r in regimes}
    lines = [f"# longfit check over transformers' decoder-only causal LMs",
             "",
             f"transformers {results['transformers']}, torch {results['torch']}: {len(results['rows'])} types, each "
             f"type's default config (`AutoConfig.for_model(TYPE).save_pretrained(DIR)`) checked with "
             f"`longfit check model=DIR seq_len={SEQ_LEN}` in the fp32 regime (`train.device=cpu`) and the GPU regime "
             "(bf16 autocast, the CUDA kernel choices). Rerun: `PYTHONPATH=src nice -n 10 python "
             "benchmarks/check_sweep.py --out benchmarks/results`.",
             "",
             "| outcome | fp32 | GPU regime |",
             "| --- | --- | --- |"]
    lines += [f"| {v} | {counts['fp32'][v]} | {counts['gpu'][v]} |" for v in VERDICTS]
    lines += ["", "| type | architecture | fp32 | GPU regime |", "| --- | --- | --- | --- |"]

    def cell(outcome: dict | None) -> str:
        if not outcome:
            return "not run"
        detail = outcome["detail"].replace("|", "\\|")
        return outcome["verdict"] + (f": {detail}" if detail else "")

    for row in sorted(results["rows"], key=lambda r: r["model_type"]):
        lines.append(f"| {row['model_type']} | {row['architecture']} | {cell(row.get('fp32'))} | {cell(row.get('gpu'))} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["rows"].sort(key=lambda r: r["model_type"])
    (out / "check_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "check_sweep.md").write_text(markdown(results))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for check_sweep.json and check_sweep.md")
    parser.add_argument("--types", nargs="*", help="these model types only (default: every decoder-only type)")
    parser.add_argument("--regimes", nargs="*", choices=list(REGIMES), default=list(REGIMES))
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows OUT/check_sweep.json already holds for the types not swept now")
    parser.add_argument("--skip-done", action="store_true", help="with --resume: sweep only the types it lacks")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per case")
    args = parser.parse_args(argv)
    results = {**versions(), "rows": []}
    existing = args.out / "check_sweep.json"
    if args.resume and existing.exists():
        results["rows"] = json.loads(existing.read_text())["rows"]
    types = args.types or decoder_only_types()
    if args.skip_done:
        done = {row["model_type"] for row in results["rows"]}
        types = [t for t in types if t not in done]
    worker = Worker(args.regimes, args.timeout)
    try:
        for model_type in types:
            row = sweep_type(worker, model_type)
            old = next((r for r in results["rows"] if r["model_type"] == model_type), None)
            if old is not None:
                results["rows"].remove(old)
                row = {**old, **row}
            results["rows"].append(row)
            print(f"{model_type}: " + "; ".join(f"{r} {row[r]['verdict']} {row[r]['detail'][:160]}"
                                                for r in args.regimes), flush=True)
            write(results, args.out)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
