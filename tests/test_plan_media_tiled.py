"""`longfit plan` of image rows under tiled decoder layers (#54, plan/tiled.py `looks_up_first_input`): the first tiled
layer's input holds the images' embeddings written over their placeholders, so it cannot be looked up again from the
token ids; the layer keeps it on the device from its forward to its backward (memory/tiled_layers.py), as a
checkpointed layer keeps its input. Before, the plan counted it as looked up again: one (seq_len, hidden) row too few
from the model forward's return to the first layer's backward (at that backward the input is counted either way)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from longfit.config import load_config  # noqa: E402
from test_plan_media import SEQ_LEN, overrides, rows, wrapper  # noqa: E402,F401 -- the module fixtures
from test_wrappers import TEXT  # noqa: E402

TILED = ("memory.tiled_layers=true", "memory.layer_tiles=3")


# measured on the shared 2-core machine (load 7-8, an empty cache): fp32 9 s (and 14 s the wrapper), bf16 27 s
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_first_tiled_layer_of_image_rows_keeps_its_input(wrapper, rows, tmp_path, dtype: str) -> None:  # noqa: F811
    """At the loss, tiled layers keep what checkpointed layers keep but the first layer's input on text rows (looked up
    again in its backward); on image rows that input too. So the plan of tiled layers is one residual-stream row
    (fp32 on one GPU, either regime) further below checkpointing's on text rows than on image rows. Before: the same
    gap on both."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.tiled import looks_up_first_input

    long_text = {"messages": [{"role": "user", "content": "context " * 600}, {"role": "assistant", "content": "1."}]}
    (tmp_path / "text.jsonl").write_text(json.dumps(long_text) + "\n")

    def gap(data: Path) -> int:
        """Bytes at the loss's backward: checkpointed layers' plan less tiled layers' (whose first looks up or
        keeps)."""
        given = [*overrides(wrapper, data, 1, "frozen", dtype), "memory.chunked_loss=false"]
        checkpointed, tiled = (plan_config(load_config(None, [*given, *extra]), 1) for extra in ((), TILED))
        assert looks_up_first_input(tiled.setup) == (tiled.setup.images is None)
        return dict(checkpointed.events)["loss backward"] - dict(tiled.events)["loss backward"]

    assert gap(tmp_path / "text.jsonl") - gap(rows) == 4 * TEXT["hidden_size"] * SEQ_LEN
