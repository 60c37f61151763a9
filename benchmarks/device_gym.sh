# Sourced by the device campaigns (device_final.sh, device_sweep.sh) as `. benchmarks/device_gym.sh NAME`:
# cd to the repository root, make $DIR = $OUT/NAME, install the carried gymnasium wheels (.whl/) into /tmp/site
# and put it and the repository on PYTHONPATH. Exits the caller when the wheels do not install.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$OUT/$1"
mkdir -p "$DIR"
cd "$ROOT" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gymnasium wheels did not install"; exit 1; }
export PYTHONPATH="/tmp/site:$ROOT"
