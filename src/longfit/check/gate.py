"""The trainer's question to `longfit check`: is this run's model computed exactly under this run's techniques?

    require_exact(cfg, "cuda")   # returns the verdict, or raises ConfigError naming the layer and part

`longfit train` and `apply_longfit` ask it before they build anything. Every model is checked -- a preset or a
checkpoint, a family the test suite proves or one it has never seen: a family is a property of the config, and the
check on a shrunken copy takes seconds on one CPU core. Its verdict is cached on disk under
`$XDG_CACHE_HOME/longfit/check_verdicts` (`~/.cache/...`) by what the check rehearses (`longfit.check.parity
.rehearsal`), nothing else: the architecture (the model's text config with the run's RoPE and dropout, less its name,
weights' dtype and token ids), the techniques as the check runs them (each memory technique on or off as resolved
for the run's device and seq_len, the checkpointed fraction, host or disk offload; LoRA's target modules; the dtype;
context parallelism on two ranks or none, and its ring or Ulysses; tensor parallelism on two ranks or none;
train.disable_dropout; train.indexer_loss, whose
KL loss the checked steps add), whether the run trains image rows (#54: then train.vision, the wrapper's config and its
image processor, so that a text verdict never answers for image rows nor an image verdict for text) and the code
(torch, transformers and peft versions, a digest of longfit's sources). Output paths, the learning rate, the steps, tile
and chunk sizes, the seed, parallel.cp and parallel.tp past 2 do not change the verdict: a run differing only in them reads it in
milliseconds. A model refused before any step (its config alone decides) is keyed by its architecture.

That key needs transformers (seconds of imports and meta-device models), so the verdict is also stored under a key
of the run's inputs as given (`input_key`), read before anything heavy is imported: the code, the device type, every
config value, the model's files (each file's bytes; a weights file over `HASHED_BYTES` by its size and modification
time) and `data.path`'s files by size and modification time (image rows are the data's). Each of them decides
the key of what is rehearsed, so a hit answers only for a run whose check would rehearse the same; a repeated
`longfit check` or `longfit train` reads its verdict in well under a second. A model or data path that is
neither a preset nor on this disk has no such key.

A model the check does not call exact is refused in one `longfit: error:` line naming the layer and part that
differs (or the part longfit refuses, or why the copy cannot be built), unless `train.accept_inexact=true`: then
the same line is printed as a warning and the run trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from longfit.config import Config, ConfigError
from longfit.models.cache import cache_dir, code_digest

UNCHECKED_KEYS = ("_name_or_path", "name_or_path", "transformers_version", "architectures", "auto_map",
                  "torch_dtype", "dtype", "pad_token_id", "bos_token_id", "eos_token_id", "quantization_config")
"""Config entries that do not change what the model computes for a row of tokens (the check draws its own
tokens and weights; QLoRA's 4-bit base is checked as a bf16 one)."""

HASHED_BYTES = 64 << 20
"""A model file up to this size is keyed by its bytes (configs, tokenizers, image processors, small weights); a
larger one (weights, which the check replaces by random ones) by its size and modification time."""


@dataclass(frozen=True)
class Verdict:
    exact: bool
    message: str
    """Empty when exact; else the check's one line (the layer and part, or the refusal)."""
    cached: bool = False
    lines: tuple[str, ...] = ()
    """What `longfit check` printed of it (empty: refused before any step, or the check could not answer)."""


def _file_fingerprint(path: Path, hashed: bool) -> list:
    stat = path.stat()
    if hashed and stat.st_size <= HASHED_BYTES:
        return [stat.st_size, hashlib.sha256(path.read_bytes()).hexdigest()]
    return [stat.st_size, stat.st_mtime_ns]


def _files_fingerprint(path: Path, hashed: bool) -> list:
    """`path`'s files (a file, or a directory's, recursively) by bytes (`hashed`) or by size and modification time."""
    if path.is_file():
        return [str(path.resolve()), _file_fingerprint(path, hashed)]
    files = sorted(f for f in path.rglob("*") if f.is_file())
    return [str(path.resolve()), [[str(f.relative_to(path)), _file_fingerprint(f, hashed)] for f in files]]


def _model_fingerprint(model: str) -> list | None:
    """What the check reads of `model` (module docstring): a preset's name (its values are code), a packaged or
    local GGUF file, a directory or a config.json file; None for a model on no local path."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import packaged_gguf

    if model in PRESETS:
        return ["preset", model]
    path = packaged_gguf(model) or Path(model).expanduser()
    return _files_fingerprint(path, hashed=True) if path.exists() else None


def input_key(cfg: Config, device_type: str) -> str | None:
    """The run's inputs as given, hashed (module docstring), computed without importing torch or transformers;
    None where the model or the data is on no local path."""
    model = _model_fingerprint(cfg.model)
    data = [None if p is None else Path(p).expanduser() for p in (cfg.data.path, cfg.data.eval_path)]
    if model is None or any(p is not None and not p.exists() for p in data):
        return None
    data_files = [None if p is None else _files_fingerprint(p, hashed=False) for p in data]
    text = json.dumps(["inputs", code_digest(), device_type, dataclasses.asdict(cfg), model, data_files],
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def verdict_key(cfg: Config, device_type: str) -> str:
    """What decides the check's verdict on `cfg`'s run on `device_type` (module docstring), hashed."""
    from longfit.check.parity import NotExact, checked_images, rehearsal
    from longfit.models.loading import resolve_model_config

    try:
        planned = rehearsal(cfg, device_type)
    except NotExact:  # refused before any step: the config alone decides
        config, techniques, images = resolve_model_config(cfg.model, cfg), None, checked_images(cfg)
    except ConfigError:  # the run's config is wrong for the model: not a verdict
        raise
    except Exception:  # noqa: BLE001 -- the copy cannot be prepared: the check fails alike under any techniques
        config, techniques, images = resolve_model_config(cfg.model, cfg), None, checked_images(cfg)
    else:
        setup = planned.setup
        config, images = planned.config, planned.images
        techniques = {"memory": setup.memory, "lora_targets": setup.lora_targets, "dtype": str(setup.dtype),
                      "cp": planned.checked_cp, "cp_method": setup.cp_method if planned.checked_cp > 1 else None,
                      "tp": planned.checked_tp,
                      "offload_to_disk": setup.offload_to_disk, "disable_dropout": setup.disable_dropout,
                      "objective": cfg.train.objective, "indexer_loss": setup.indexer_loss}
    if images is not None:  # image rows are checked on the wrapper's copy: their verdict is theirs alone
        from longfit.check.media import image_architecture

        images = [images, image_architecture(cfg, UNCHECKED_KEYS)]
    architecture = {k: v for k, v in config.to_dict().items() if k not in UNCHECKED_KEYS}
    text = json.dumps([code_digest(), architecture, techniques, images], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _load(key: str) -> Verdict | None:
    try:
        values = json.loads((cache_dir("check_verdicts") / f"{key}.json").read_text())
        return Verdict(bool(values["exact"]), str(values["message"]), True, tuple(map(str, values.get("lines", ()))))
    except (OSError, ValueError, KeyError):  # not checked yet, or unreadable: check again
        return None


def _store(key: str, verdict: Verdict) -> None:
    path = cache_dir("check_verdicts") / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"exact": verdict.exact, "message": verdict.message, "lines": verdict.lines}))
        partial.replace(path)  # atomic: ranks checking at once read the old file or the new one
    except OSError:  # a read-only home: checked again next time
        pass


def run_check(cfg: Config, device_type: str) -> Verdict:
    """`longfit check` of `cfg` on this process, one CPU thread: its verdict (a failure of the check itself included:
    a verdict that cannot be proven is not exact), with the report's lines."""
    import torch

    from longfit.check.parity import NotExact, check_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the copy's tensors are tiny: threads cost more than they bring
    lines: tuple[str, ...] = ()
    try:
        report = check_run(cfg, device_type)
        lines = tuple(report.lines())
        report.raise_if_not_exact()
    except NotExact as refusal:
        return Verdict(False, str(refusal), lines=lines)
    except ConfigError:  # the run's config itself is wrong (e.g. LoRA targets the model lacks): not a verdict
        raise
    except Exception as error:  # noqa: BLE001 -- the check could not answer: nothing proves the run exact
        lines = [line for line in str(error).splitlines() if line.strip()]
        return Verdict(False, f"{cfg.model} could not be checked: {type(error).__name__}: {lines[0] if lines else ''}")
    finally:
        torch.set_num_threads(threads)
    return Verdict(True, "", lines=lines)


def checked(cfg: Config, device_type: str) -> Verdict:
    """The check's verdict on `cfg`'s run on `device_type`: cached under the run's inputs, else under what it
    rehearses, else checked now and stored under both (module docstring)."""
    from longfit.models.source import check_model_dir

    inputs = input_key(cfg, device_type)
    verdict = _load(inputs) if inputs else None
    if verdict is not None:
        return verdict
    from longfit.check.parity import reused_rehearsals

    with reused_rehearsals():  # the key's rehearsal is the check's
        try:
            key = verdict_key(cfg, device_type)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 -- a config the check cannot read: the trainer's refusal of the directory,
            check_model_dir(cfg.model)  # or the check's own one line on it, not cached
            return run_check(cfg, device_type)
        verdict = _load(key)
        if verdict is None:
            verdict = run_check(cfg, device_type)
            _store(key, verdict)
    if inputs and input_key(cfg, device_type) == inputs:  # the files unchanged while it was checked
        _store(inputs, verdict)
    return verdict


def require_exact(cfg: Config, device_type: str, log=print) -> Verdict:
    """The check's verdict on `cfg`'s run on `device_type` ("cuda" or "cpu"), cached (module docstring); raises
    ConfigError with the check's line when it is not exact, unless `cfg.train.accept_inexact`."""
    verdict = checked(cfg, device_type)
    if verdict.exact:
        return verdict
    if not cfg.train.accept_inexact:
        raise ConfigError(f"{verdict.message}; `longfit check` with this run's config shows the comparison, "
                          "train.accept_inexact=true trains it anyway")
    log(f"warning: {verdict.message}; training it anyway (train.accept_inexact=true)")
    return verdict
