# Sourced by the device scripts (bench/*.sh): the carried wheels (.whl, ../shared/device/wheels.sh) and this checkout
# installed into /tmp/site, results under $OUT, wandb off (the device image has no wandb).
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
  >/dev/null || exit 1
export WANDB_MODE=disabled
