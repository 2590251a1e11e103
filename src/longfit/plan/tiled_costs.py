"""PROVISIONAL (replaced by `python -m longfit.plan.calibrate --tiled` output)."""

_E = {
    'input_kept': True,
    'saved': {},
    'forward_peak': {'h': 1.08, 'q': 1.08, 'kv': 4.25, 'nh': -8.42, 'lora': 0.7, 'one': -172.88, 'h_tile': 2.82, 'f_tile': 7.95, 'q_tile': 2.82, 'kv_tile': -0.48, 'nh_tile': 23.52, 'lora_tile': -1.86, 'one_tile': 478.79},
    'backward_peak': {'h': 0.99, 'q': 0.99, 'kv': 12.06, 'nh': 0.54, 'lora': 0.01, 'one': -6.6, 'h_tile': 10.01, 'f_tile': 11.97, 'q_tile': 10.01, 'kv_tile': 0.06, 'nh_tile': 5.64, 'lora_tile': 1.61, 'one_tile': 47.9},
}
TILED_LAYER_COSTS = {(f, r, t, None): _E for f in ("llama", "gemma3") for r in ("bf16", "autocast", "fp32") for t in ("full", "lora")}
