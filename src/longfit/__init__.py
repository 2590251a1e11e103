"""longfit: fine-tune Hugging Face causal LMs on very long contexts.

Library API (imported lazily so that `import longfit` and `longfit --help` stay instant):
    longfit.load_config(path, overrides)      typed Config
    longfit.load_model(name_or_dir, ...)      HF causal LM using longfit attention
    longfit.CausalLMLoss(model, ...)          module whose forward returns the summed token loss
    longfit.ParallelDims / longfit.parallelize(loss_module, dims, cfg, mesh)
                                              tensor + context parallelism, checkpointing/offload, FSDP2
    longfit.shard_batch(batch, cp_rank, cp, layout)
    longfit.train(cfg)                        the trainer used by `longfit train`
    longfit.check_run(cfg)                    `longfit check`: is cfg's model computed exactly under its techniques?
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "longfit.config",
    "load_config": "longfit.config",
    "load_model": "longfit.models.loading",
    "load_tokenizer": "longfit.models.loading",
    "CausalLMLoss": "longfit.memory.loss",
    "ParallelDims": "longfit.parallel.dims",
    "parallelize": "longfit.parallel.parallelize",
    "shard_batch": "longfit.parallel.batch",
    "train": "longfit.train.loop",
    "check_run": "longfit.check.parity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'longfit' has no attribute {name!r}")
