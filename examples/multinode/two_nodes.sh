#!/bin/bash
# The same run without a scheduler: this command on each of the two nodes, node001 being the first. The nodes
# find each other at node001:29500 (a free port there); the rendezvous id defaults to one derived from output_dir.
set -euo pipefail
longfit train examples/multinode/llama8b_1m_cp16.yaml --nproc 8 --nnodes 2 --rdzv-endpoint node001:29500 --max-restarts 3
