"""`longfit bench memory`: end to end on a tiny local model (real subprocess workers), the fit and the search."""

import json
import subprocess
import sys

import pytest

from longfit.bench.memory import fit_line, fitted_length, gallop_search
from longfit.cli import build_parser, main, parse


def run_memory_bench(argv: list[str]) -> int:
    return main(["bench", "memory", "--device", "cpu", *argv])

# Each run is a fresh process (a few seconds of imports here): (b2) is left out, (b3) = (b2) + tiled MLP,
# (b5) tiled decoder layers.
CONFIGS = ("hf-sdpa", "lf-ckpt", "lf-tiled-mlp", "lf-tiled-layers")


def _bench(tmp_path, tiny_model_dir, *extra):
    out = tmp_path / "bench"
    # loss_chunk and mlp_tiles small enough that the tiny model's loss and MLP are really split at these lengths
    argv = ["--model", str(tiny_model_dir), "--lengths", "1024,2048", "--steps", "1", "--out", str(out),
            "--set", "memory.loss_chunk=256", "--set", "memory.mlp_tiles=3", "--set", "memory.layer_tiles=4", *extra]
    return run_memory_bench(argv), out


@pytest.mark.slow  # 48 s; the default suite's 15 minutes (2026-11-27)
def test_end_to_end_tables_plot_losses_and_ratios(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("matplotlib")  # the report's plot
    rc, out = _bench(tmp_path, tiny_model_dir, "--configs", ",".join(CONFIGS))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    markdown = (out / "memory.md").read_text()
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert sorted((r["config"], r["length"]) for r in rows) == sorted((c, n) for c in CONFIGS for n in (1024, 2048))
    assert all("error" not in r for r in rows)
    base = {r["length"]: r for r in rows if r["config"] == "hf-sdpa"}
    for r in rows:
        ref = base[r["length"]]
        # the techniques are exact: same weights, same batch, same loss as plain transformers
        assert abs(r["loss"] - ref["loss"]) < 1e-4, (r["config"], r["loss"], ref["loss"])
        assert r["peak_bytes"] > 0 and r["total_bytes"] == r["baseline_bytes"] + r["peak_bytes"]
        # ratios come from the measured numbers, and the tables show those ratios
        assert r["memory_ratio"] == pytest.approx(r["peak_bytes"] / ref["peak_bytes"])
        assert r["total_ratio"] == pytest.approx(r["total_bytes"] / ref["total_bytes"])
        assert r["time_ratio"] == pytest.approx(r["step_s"] / ref["step_s"])
        assert r["loss_diff"] == pytest.approx(abs(r["loss"] - ref["loss"]))
        cells = [str(r["length"]), f"{r['peak_bytes'] / 2**30:.3f}", f"{r['memory_ratio']:.3f}", f"{r['time_ratio']:.3f}"]
        for text in (markdown, printed):
            assert any(all(c in line for c in cells) for line in text.splitlines()), (r["config"], cells)
    # the largest-L column is the measured totals' line solved for the budget (8 GiB by default)
    for entry in results["largest"]:
        points = [(r["length"], r["total_bytes"]) for r in rows if r["config"] == entry["config"]]
        line = fit_line(points)
        assert entry["line"] == pytest.approx(list(line))
        assert entry["largest"] == fitted_length(line, 8 * 2**30, multiple=128)
        assert entry["how"].endswith("(linear fit)")
    assert "Loss agreement with (a)" in markdown and "Largest L with total peak <= 8.00 GiB" in markdown


def test_fit_line_and_fitted_length():
    line = fit_line([(1000, 3.0 + 0.5 * 1000), (2000, 3.0 + 0.5 * 2000), (4000, 3.0 + 0.5 * 4000)])
    assert line == pytest.approx((3.0, 0.5))
    assert fitted_length(line, budget=3.0 + 0.5 * 5000) == 5000
    assert fitted_length(line, budget=3.0 + 0.5 * 5000, multiple=128) == 4992
    assert fitted_length((10.0, 0.5), budget=5.0) is None  # the constant part alone is over budget
    assert fitted_length((1.0, 0.0), budget=5.0) is None  # flat: no largest L
    assert fit_line([(1000, 1.0), (1000, 2.0)]) is None


@pytest.mark.parametrize("start", [256, 4864, 4608, 5120, 20000, 1 << 20])
def test_gallop_search_finds_the_largest_fitting_length(start):
    probes = []

    def fits(length):
        probes.append(length)
        return length <= 5000

    assert gallop_search(fits, start, resolution=256, limit=1 << 22) == 4864  # 19 x 256
    assert all(length % 256 == 0 for length in probes)
    assert len(probes) == len(set(probes))
    if start in (4864, 5120):  # a good estimate needs two runs
        assert len(probes) == 2


def test_gallop_search_uses_known_lengths_and_limits():
    calls = []

    def fits(length):
        calls.append(length)
        return length <= 3000

    # 2048 measured fitting, 4096 measured failing: only the lengths in between are probed
    assert gallop_search(fits, 2048, 512, limit=1 << 20, known_fit=2048, known_fail=4096) == 2560
    assert all(2048 < c < 4096 for c in calls)
    calls.clear()
    # a measured failure between multiples of the resolution: 1024 is still probed
    assert gallop_search(fits, 700, 1024, limit=1 << 20, known_fail=1500) == 1024
    assert calls == [1024]
    assert gallop_search(lambda n: False, 4096, 512, limit=1 << 20) == 0  # nothing fits
    assert gallop_search(lambda n: True, 1024, 512, limit=8192) == 8192  # everything up to the limit fits


def test_default_configurations_leave_offload_to_cuda():
    from longfit.bench.memory import CONFIG_NAMES, _validate

    for device, expected in (("cpu", [c for c in CONFIG_NAMES if c != "lf-offload"]), ("cuda", list(CONFIG_NAMES))):
        args = parse(build_parser(), ["bench", "memory", "--device", device])
        assert _validate(args) is None
        assert args.config_list == expected
        assert args.dtype == ("fp32" if device == "cpu" else "bf16")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "4k"], "--lengths"),
        (["--lengths", "1"], ">= 2"),
        (["--configs", "hf-sdpa,flash"], "unknown flash"),
        (["--set", "memory.chunked_loss=false"], "--configs"),
        (["--set", "memory.loss_chunk"], "KEY=VALUE"),
        (["--budget", "lots"], "8GiB"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_name_the_fix(argv, message, capsys, tmp_path):
    assert run_memory_bench([*argv, "--out", str(tmp_path / "never")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom longfit.cli import main\n"
        "try:\n    main(['bench', 'memory', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--lengths" in proc.stdout


@pytest.mark.slow
def test_search_runs_real_lengths(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("matplotlib")  # the report's plot
    rc, out = _bench(tmp_path, tiny_model_dir, "--configs", "lf-tiled-mlp")
    assert rc == 0
    first = json.loads((out / "results.json").read_text())["rows"]
    # a budget a third of a 1024-token step above the measured 2048 total: the answer is near 2048
    total = {r["length"]: r["total_bytes"] for r in first}
    budget = total[2048] + (total[2048] - total[1024]) // 3
    rc, out = _bench(tmp_path, tiny_model_dir, "--configs", "lf-tiled-mlp", "--search",
                     "--search-resolution", "512", "--budget", f"{budget / 2**20:.3f}MiB")
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    entry, budget = results["largest"][0], results["args"]["budget_bytes"]
    assert entry["how"].startswith("searched") and entry["probes"]
    runs = entry["probes"] + results["rows"]
    fitting = {r["length"] for r in runs if "error" not in r and r["total_bytes"] <= budget}
    failing = {r["length"] for r in runs if "error" in r or r["total_bytes"] > budget}
    # the answer was run and fitted, one resolution step more was run and did not
    assert entry["largest"] in fitting and entry["largest"] + 512 in failing
