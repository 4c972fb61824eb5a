#!/bin/sh
# install_package.sh PYTHON SOURCE: build nemo-orch's wheel from the checkout SOURCE and install
# it into PYTHON's environment as a user installs a release: the wheel, not an editable
# checkout, and without resolving again the requirements installed before it (the container
# pins them against its base image). The Dockerfile runs this script, and so does
# tests/test_packaging.py, into a fresh virtual environment outside the checkout.
set -eu
python=$1
source=$2
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dist" "$source"
"$python" -m pip install --quiet --no-deps --no-index "$dist"/nemo_orch-*.whl
