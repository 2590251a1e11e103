"""`longfit check` over every decoder-only causal LM type of transformers, both regimes (longfit.check.sweep).

    PYTHONPATH=src nice -n 10 python benchmarks/check_sweep.py --out benchmarks/results [--types gpt2 llama] [--resume]
"""

from longfit.check.sweep import main

if __name__ == "__main__":
    main()
