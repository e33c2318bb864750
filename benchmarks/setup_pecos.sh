#!/usr/bin/env bash
# PECOS (PyPI libpecos) in a virtual environment of its own, for benchmarks/clustering_vs_pecos.py only:
# libpecos pins numpy < 2, which the project's environment cannot have.
#
#   bash benchmarks/setup_pecos.sh [VENV]        # VENV defaults to .venv-pecos
#   python benchmarks/clustering_vs_pecos.py --pecos-python VENV/bin/python ...
#
# libpecos depends on torch. torch goes in first, pinned (TORCH_VERSION, default the version this project is
# tested with), so pip takes the CPU wheel from the sources it is configured with (a local wheel folder, or
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) instead of resolving torch for libpecos and
# pulling gigabytes of CUDA wheels.
set -euo pipefail

venv="${1:-.venv-pecos}"
torch_version="${TORCH_VERSION:-2.13.0}"

python3 -m venv "$venv"
"$venv/bin/pip" install "torch==$torch_version"
"$venv/bin/pip" install libpecos
"$venv/bin/python" -c "import numpy, pecos; print('libpecos', pecos.__version__, 'with numpy', numpy.__version__)"
echo "PECOS python: $venv/bin/python"
